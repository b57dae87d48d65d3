"""An output_dir named by an fsspec URL, translated once, at load: the run writes into a local folder and
uploads its checkpoints to the URL.

`output_dir: s3://bucket/run` becomes `save.remote_dir: s3://bucket/run` and `output_dir:` the local staging
folder (`save.staging_dir`, default kiln.utils.storage_urls.default_staging), so everything that writes
files (checkpoints, logs, trackers, the exported model) writes them locally as for any run, and the
checkpoint code alone talks to the store. A URL whose store's file system is not installed fails here,
in one sentence naming the kiln extra, before anything is built. `file://` URLs are local folders."""

from __future__ import annotations

from typing import Any

from kiln.utils.errors import ConfigError
from kiln.utils.storage_urls import check_file_system, default_staging, is_remote, local_path


def place_output_dir(cfg: Any) -> None:
    """Rewrite `cfg` (a DictConfig being loaded) for an output_dir, save.remote_dir or
    resume_from_checkpoint that is a URL."""
    out = str(cfg.output_dir)
    save = cfg.save
    if is_remote(out):
        check_file_system(out, "output_dir")
        url = out.rstrip("/")
        if save.remote_dir and str(save.remote_dir).rstrip("/") != url:
            raise ConfigError(
                f"output_dir {out} and save.remote_dir {save.remote_dir} name two stores; give the URL once, as "
                "output_dir (the local copy then goes to save.staging_dir)."
            )
        save.remote_dir = url
        cfg.output_dir = str(save.staging_dir) if save.staging_dir else default_staging(url)
    else:
        cfg.output_dir = local_path(out)
    if save.remote_dir:
        if not is_remote(str(save.remote_dir)):
            raise ConfigError(
                f"save.remote_dir {save.remote_dir!r} is not the URL of a store (s3://, gs://, memory://); "
                "leave it unset for a local output_dir."
            )
        check_file_system(str(save.remote_dir), "save.remote_dir")
        save.remote_dir = str(save.remote_dir).rstrip("/")  # a trial's prefix is joined with "/": no empty key part
    resume = cfg.resume_from_checkpoint
    if isinstance(resume, str) and is_remote(resume):
        check_file_system(resume, "resume_from_checkpoint")
    elif isinstance(resume, str):
        cfg.resume_from_checkpoint = local_path(resume)
