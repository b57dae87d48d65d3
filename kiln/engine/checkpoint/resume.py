"""Which checkpoint a run resumes from, decided once for the whole job.

Checking a checkpoint's checksums reads every file, so with many ranks on one filesystem only the
writer (global rank 0) checks and the others take its answer, refusal included; with
`save.on_each_node` every node has its own copy, so each rank checks its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from kiln.engine.checkpoint.files import resolve_resume
from kiln.utils.errors import CheckpointError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.strategies.base import Strategy


def choose_resume(resume: Any, config: "DictConfig", strategy: "Strategy") -> Optional[str]:
    """The checkpoint folder to resume from (None: start fresh), the same on every rank."""
    output_dir = str(config.output_dir)
    if strategy.world_size <= 1 or config.save.on_each_node:
        return resolve_resume(resume, output_dir)
    path: Optional[str] = None
    error: Optional[str] = None
    if strategy.is_global_zero:
        try:
            path = resolve_resume(resume, output_dir)
        except CheckpointError as err:
            error = str(err)
    path, error = strategy.broadcast_object((path, error), src=0)
    if error is not None:
        raise CheckpointError(error)
    return path
