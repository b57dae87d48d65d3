"""What a run does with its object store (`save.remote_dir`, set from an output_dir URL at load:
kiln.config.remote_dir): the plug-in between the local checkpoints and kiln.engine.checkpoint.remote.

- **Publish**: once a checkpoint is complete in the local output_dir (its COMPLETE marker written, the
  folder renamed into place, local rotation done), the writer uploads it, marker last, then rotates the
  store by the local rule. An upload that fails past its retries is a warning: training goes on, the
  checkpoint stays in the local folder, and the store's newest intact checkpoint is the previous one. With
  `save.async_save` this runs on the background writer, so the step loop does not wait for the upload.
- **Resume**: `resume_from_checkpoint: true` downloads the store's newest intact checkpoint (digests
  checked) into the local folder; a checkpoint URL downloads that one.
- **Final outputs**: `save_model()` and `save_state()` into the run's own output_dir upload the files at
  its top (the exported model, trainer_state.json, the *_results.json); the logs (output_dir/runs) stay local.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

from kiln.engine.checkpoint.remote import RemoteCheckpoints, UploadFailed
from kiln.utils.storage_urls import default_staging

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)


def store_of(config: DictConfig) -> RemoteCheckpoints | None:
    """The run's store, or None for a run without `save.remote_dir`."""
    url = config.save.remote_dir
    return RemoteCheckpoints(str(url), options(config)) if url else None


def options(config: DictConfig) -> dict[str, Any]:
    """`save.storage_options` as plain containers, for fsspec."""
    from omegaconf import OmegaConf

    raw = config.save.storage_options
    return dict(OmegaConf.to_container(raw, resolve=True) if raw is not None else {})  # type: ignore[arg-type]


def publish(store: RemoteCheckpoints, local: str, limit: int | None, best: str | None) -> None:
    """Upload the complete local checkpoint `local`, then rotate the store (`limit` newest kept, and the
    checkpoint named by the path `best`). A failure of either is a warning: the run goes on, and what
    the store held is untouched (an upload) or kept (a rotation)."""
    name = os.path.basename(os.path.normpath(local))
    try:
        store.upload(local)
    except UploadFailed as err:
        newest = f"is {store.uploaded}" if store.uploaded else "is the newest one it held before"
        warnings.warn(
            f"{name} was saved in {os.path.dirname(local)} but not uploaded to {store.url}: {err} The store's newest "
            f"intact checkpoint {newest}; training goes on.",
            stacklevel=2,
        )
        return
    log.info("Uploaded %s to %s.", name, store.url)
    if limit:
        try:
            store.rotate(limit, os.path.basename(os.path.normpath(best)) if best else None)
        except Exception as err:  # the stores' clients raise their own types (botocore, aiohttp, OSError)
            warnings.warn(
                f"Rotating the checkpoints on {store.url} failed ({type(err).__name__}: {err}); it keeps more than "
                f"save.total_limit={limit} until the next save rotates them; training goes on.",
                stacklevel=2,
            )


def upload_outputs(store: RemoteCheckpoints, folder: str) -> None:
    """Upload the files at the top of the run's local folder (what save_model and save_state wrote); a
    failure is a warning naming the local folder, which keeps them."""
    try:
        store.upload_files(folder)
    except UploadFailed as err:
        warnings.warn(f"The run's final files stay in {folder}: {err}", stacklevel=2)


def fetch_checkpoint(
    url: str, storage_options: dict[str, Any] | None = None, key: Any = None, into: str | None = None
) -> str:
    """Download the checkpoint at `url` (`s3://bucket/run/checkpoint-500`), digests checked, into `into`
    (default: the local folder of its run's URL, kiln.utils.storage_urls.default_staging); returns the
    local path. A CheckpointError when it is not whole on the store or fails its digests."""
    parent, _, name = url.rstrip("/").rpartition("/")
    store = RemoteCheckpoints(parent, storage_options)
    return store.download(name, into or default_staging(parent), key)
