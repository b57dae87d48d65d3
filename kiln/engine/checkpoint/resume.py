"""Which checkpoint a run resumes from, decided once for the whole job.

`resume_from_checkpoint` takes Hugging Face's values and raises what HF's Trainer raises:
`true` resumes from the newest complete checkpoint in `output_dir` and is a `ValueError` when there
is none ("No valid checkpoint found in output directory ..."); a path must be a complete checkpoint
folder, else a `ValueError` too. kiln's one addition, `if_exists`, is for jobs that are restarted
without being told so (an elastic agent's restart, a requeued SLURM job, a pre-empted pod): it
resumes from the newest complete checkpoint when there is one and starts fresh, with one log line,
when there is none. HF never resumes on its own, so nothing does unless this value is set.

Checking a checkpoint's checksums reads every file, so with many ranks on one filesystem only the
writer (global rank 0) checks and the others take its answer, refusal included; with
`save.on_each_node` every node has its own copy, so each rank checks its own; with an object store
too, each node's writer downloads its node's copy, and a refusal names the node whose download refused. The check covers the
signature too when `save.signing_key_env` names a key (kiln.engine.checkpoint.signing), and, for a
checkpoint HF's Trainer wrote, what its weights allow (kiln.engine.checkpoint.hf_folder).

A run with an object store (`save.remote_dir`, an output_dir URL) resumes from the store: `true` and
`if_exists` download its newest intact checkpoint into the local output_dir (kiln.engine.checkpoint.remote),
on the writer ranks; a checkpoint URL (`s3://bucket/run/checkpoint-500`) downloads that one. Before `true`
and `if_exists` look, a checkpoint whole in the staging folders but newer than the store's newest (its run
was killed before uploading it) is uploaded (RunUploads.publish_stranded)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from kiln.engine.checkpoint.files import hf_damage, is_hf_checkpoint, latest_checkpoint, why_damaged, why_incomplete
from kiln.engine.checkpoint.output_dir import is_writer
from kiln.engine.checkpoint.remote_run import RunUploads, fetch_checkpoint, options, store_of
from kiln.engine.checkpoint.signing import SigningKey, signing_key
from kiln.utils.errors import CheckpointError
from kiln.utils.storage_urls import is_remote

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)

#: the value that resumes when a checkpoint exists and starts fresh otherwise
IF_EXISTS = "if_exists"


class ResumeError(CheckpointError, ValueError):
    """`resume_from_checkpoint` names nothing to resume from. A `ValueError`, as HF's Trainer raises
    for the same inputs, and a `CheckpointError`, as kiln raised before."""


def resolve_resume(
    resume: Any, output_dir: str, key: SigningKey | None = None, config: DictConfig | None = None
) -> str | None:
    """The checkpoint folder `resume` asks for, or None to start fresh.

    None / False / "false" -> None; True / "true" -> the newest complete checkpoint in `output_dir`
    (ResumeError when there is none); "if_exists" -> the same, or None when there is none; anything
    else is a path to one checkpoint folder, or the URL of one on a store (ResumeError unless it is complete
    and intact). `key`: the signing key a checkpoint must be signed with (kiln.engine.checkpoint.signing),
    None for none. `config`: the run's, whose store (save.remote_dir, save.storage_options) is used."""
    if _off(resume):
        return None
    store = store_of(config) if config is not None else None
    latest = resume is True or (isinstance(resume, str) and resume.lower() == "true")
    if _newest(resume):
        if store is not None:
            path, where = store.download_newest(output_dir, key), store.url
        else:
            path, where = latest_checkpoint(output_dir, verify=True, key=key), output_dir
        if path is None and latest:
            raise ResumeError(
                f"No valid checkpoint found in output directory ({where}): resume_from_checkpoint=true needs a "
                f"complete checkpoint-<step> folder there; name a checkpoint path, or use resume_from_checkpoint={IF_EXISTS} "
                "to start fresh when there is none."
            )
        if path is None:
            log.info(
                "resume_from_checkpoint=%s: %s holds no complete checkpoint, so training starts from step 0.",
                IF_EXISTS,
                where,
            )
        return path
    if isinstance(resume, str) and is_remote(resume):
        into = output_dir if store is not None and resume.rstrip("/").rpartition("/")[0] == store.url else None
        try:
            return fetch_checkpoint(resume, options(config) if config is not None else None, key, into)
        except CheckpointError as err:
            raise ResumeError(str(err)) from None
    path = os.fspath(resume)
    if not os.path.isdir(path):  # HF's sentence first, as users search for it
        what = "a file, not a folder" if os.path.exists(path) else "no such folder"
        raise ResumeError(
            f"Can't find a valid checkpoint at {path} ({what}): name a checkpoint-<step> folder, or use "
            f"resume_from_checkpoint=true (or {IF_EXISTS}) for the newest one in output_dir."
        )
    hf = is_hf_checkpoint(path)
    if not hf and (incomplete := why_incomplete(path)) is not None:
        raise ResumeError(
            f"{path} is incomplete or damaged ({incomplete}); resume from another checkpoint, or use "
            "resume_from_checkpoint=true to pick the newest complete one."
        )
    reason = hf_damage(path, key) if hf else why_damaged(path, key)
    if reason is not None:
        raise ResumeError(
            f"{path} is damaged: {reason}. Resume from another checkpoint, or use "
            "resume_from_checkpoint=true to pick the newest intact one."
        )
    return path


def choose_resume(resume: Any, config: DictConfig, strategy: Strategy) -> str | None:
    """The checkpoint folder to resume from (None: start fresh), the same on every rank."""
    output_dir = str(config.output_dir)
    key = signing_key(config.save.signing_key_env)
    if strategy.is_global_zero:
        _warn_restart_without_resume(resume, output_dir)
    remote = bool(config.save.remote_dir)
    if remote and _newest(resume):  # a checkpoint its run was killed before uploading goes up first
        RunUploads(config, strategy, key).publish_stranded(is_writer(config, strategy))
    if strategy.world_size <= 1 or (config.save.on_each_node and not remote):
        return resolve_resume(resume, output_dir, key, config)
    path: str | None = None
    error: str | None = None
    resolves = (
        is_writer(config, strategy) if remote else strategy.is_global_zero
    )  # a store: each copy's writer downloads
    if resolves:
        try:
            path = resolve_resume(resume, output_dir, key, config)
        except ResumeError as err:
            error = str(err)
    if remote:  # every writer's answer: the first refusal, else the path its node's writer downloaded to
        answers = strategy.all_gather_object((path, error, strategy.node_rank if resolves else None))
        refusals = [(node, e) for _, e, node in answers if e]
        ours = [p for p, _, node in answers if node == strategy.node_rank]
        path, error = (ours or [answers[0][0]])[0], None
        if refusals:  # several nodes download their own copies: say whose download refused
            several = sum(node is not None for _, _, node in answers) > 1
            error = f"Node {refusals[0][0]} cannot resume: {refusals[0][1]}" if several else refusals[0][1]
    else:
        path, error = strategy.broadcast_object((path, error), src=0)
    if error is not None:
        raise ResumeError(error)
    return path


def _warn_restart_without_resume(resume: Any, output_dir: str) -> None:
    """A launcher restarted this job (torchrun's elastic agent, a SLURM requeue) but nothing asks to
    resume: say how to, since otherwise the attempt starts from step 0 (or is refused when the
    earlier attempt left checkpoints)."""
    from kiln.launch.environment import detect

    restarts = detect().restart_count
    if restarts and _off(resume):
        log.warning(
            "This is restart %d of the job (the launcher restarted it) and resume_from_checkpoint is not set, so "
            "it starts from step 0; set resume_from_checkpoint=%s to resume from the newest checkpoint in %s.",
            restarts,
            IF_EXISTS,
            output_dir,
        )


def _newest(resume: Any) -> bool:
    """Whether `resume` asks for the newest checkpoint (true or if_exists), not a named one."""
    return resume is True or (isinstance(resume, str) and (resume.lower() == "true" or resume == IF_EXISTS))


def _off(resume: Any) -> bool:
    """Whether `resume` asks for no resume at all."""
    return resume is None or resume is False or (isinstance(resume, str) and resume.lower() in ("", "false", "none"))
