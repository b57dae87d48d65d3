"""Rank-aware behaviour that is not a collective: per-rank log levels (HF's `log_level`,
`log_level_replica`, `log_on_each_node`) and `main_process_first`.

Which process is "main" for logging follows HF's `should_log`: each node's local rank 0 when
`log.on_each_node` (the default), otherwise only global rank 0. Progress bars and logger runs are
rank 0 only by construction elsewhere (ProgressCallback, LoggerCallback)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def should_log(config: DictConfig, strategy: Strategy) -> bool:
    """Whether this process logs at the main level (`log.level`) rather than `log.level_replica`."""
    return strategy.is_local_zero if config.log.on_each_node else strategy.is_global_zero


def process_log_level(config: DictConfig, strategy: Strategy) -> int | None:
    """The `logging` level for this process, or None for "passive" (leave the level alone)."""
    name = config.log.level if should_log(config, strategy) else config.log.level_replica
    return LEVELS.get(str(name))


def configure_logging(config: DictConfig, strategy: Strategy) -> int | None:
    """Apply this process's level to kiln's logger (and to Transformers' if it is already imported,
    as HF's Trainer does). Returns the level set, or None when passive."""
    level = process_log_level(config, strategy)
    if level is None:
        return None
    logging.getLogger("kiln").setLevel(level)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(level)
    return level


@contextlib.contextmanager
def main_process_first(local: bool = True, desc: str = "work", strategy: Strategy | None = None) -> Iterator[None]:
    """Run the block on the main process first, then on the others (HF's `main_process_first`):
    e.g. dataset preprocessing that writes a cache the replicas then read.

    `local=True`: each node's local rank 0 goes first (node-local caches); `local=False`: only global
    rank 0 (a shared filesystem). Pass `strategy=trainer.strategy` once a Trainer exists; before that
    the launcher's environment is used and the process group is created if needed (the DDP strategy
    then reuses it). If the main process raises inside the block, the others are not released: they
    stop with the job (the launcher ends them, or their wait fails when the main process exits)."""
    rank, local_rank, world, barrier = _topology(strategy)
    if world <= 1:
        yield
        return
    is_main = local_rank == 0 if local else rank == 0
    who = "main local process" if local else "main process"
    if not is_main:
        log.debug("%d: waiting for the %s to perform %s", rank, who, desc)
        barrier()
    yield
    if is_main:
        log.debug("%d: %s completed %s, releasing all replicas", rank, who, desc)
        barrier()


def check_same_output_dir(config: DictConfig, strategy: Strategy) -> None:
    """Every rank must write into one output_dir (checkpoints are assembled there from every rank's
    files); refuse a mismatch before training instead of failing later inside a save. With
    `save_on_each_node` each node writes its own copy (no shared filesystem), so only ranks of one
    node must agree."""
    if strategy.world_size <= 1:
        return
    import os

    from kiln.utils.errors import ConfigError

    per_node = bool(config.save.on_each_node)
    mine = (strategy.node_rank if per_node else 0, os.path.normpath(str(config.output_dir)))
    everyone = strategy.all_gather_object(mine)
    groups: dict[int, set[str]] = {}
    for node, path in everyone:
        groups.setdefault(node, set()).add(path)
    if any(len(paths) > 1 for paths in groups.values()):
        shown = ", ".join(f"rank {r}: {d!r}" for r, (_, d) in enumerate(everyone))
        where = "ranks of one node" if per_node else "ranks"
        raise ConfigError(f"output_dir differs between {where} ({shown}); give every rank the same output_dir.")


def _topology(strategy: Strategy | None) -> tuple[int, int, int, Any]:
    if strategy is not None:
        return strategy.global_rank, strategy.local_rank, strategy.world_size, strategy.barrier
    from kiln.launch.environment import detect

    env = detect()
    if not env.distributed:
        return env.rank, env.local_rank, env.world_size, None
    from kiln.strategies.process_group import barrier, join_default_group

    device, backend = join_default_group(env)
    return env.rank, env.local_rank, env.world_size, lambda: barrier(device, backend)
