"""Stopping the other ranks when `fit()` fails on one (issue 57): `abort_default_group`.

A rank whose fit raises used to stop its peers only by dying: its sockets closed with the process, and a
peer's pending collective failed then. A script that catches the error and keeps its process alive kept
the peers waiting in their next all-reduce or pipeline receive until the collective timeout (30 minutes by
default). The failing rank therefore records its error in the job's store and aborts every process group
of this process:

- gloo has no working abort (in torch 2.13 `ProcessGroup.abort()` and `shutdown()` leave its connections
  open: measured, a peer's pending all-reduce or `recv` waited until the failing process exited), but a
  freed group closes its connections, and a peer's pending or next collective then fails at once
  ("Connection closed by peer"; measured ~0 s after `destroy_process_group`). So the group is destroyed,
  and the strategy drops what holds it (its wrapper, mesh, pipeline stages; `Strategy.abort`), so that it
  is freed while the user's script still holds the Trainer and the exception.
- NCCL: `_abort_process_group()` first, which calls ncclCommAbort on every communicator (a kernel in
  flight is cancelled rather than waited for, as `destroy_process_group`'s shutdown may); the peers' NCCL
  watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, set by torchrun) then fails their collectives.

The record lets a peer name the rank that failed first (`RankFailed`), and lets that rank keep its own
exception: `compare_set` writes it only when no rank wrote one before. A store this rank hosts (no launcher
agent: rank 0 hosts it) is kept alive, so that the peers can still read the record.

After the abort this process has no process group: collectives, `evaluate` and a second `fit` cannot run
in it; a new fit needs a new process (or every rank re-initialising the group)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from kiln.strategies.process_group import destroy_default_group, keep_default_store

log = logging.getLogger(__name__)

#: the store key holding the first failed fit of the job: {"rank": int, "error": "Type: message"}
FAILED_FIT = "kiln/failed_fit"


def record_failure(rank: int, error: BaseException) -> dict[str, Any] | None:
    """Record this rank's failure in the job's store unless another rank's is there already; returns that
    other rank's record ({"rank", "error"}), or None when this rank is the first, failed with the same error
    (a config error raised alike on every rank keeps its message), or the store is gone."""
    store = keep_default_store()
    if store is None:
        return None
    mine = json.dumps({"rank": rank, "error": f"{type(error).__name__}: {error}"[:2000]})
    try:
        store.set_timeout(timedelta(seconds=5))
        first = json.loads(store.compare_set(FAILED_FIT, "", mine))
    except Exception:  # noqa: BLE001 - a store that no longer answers: the peers' own errors still stop them
        log.debug("could not record this rank's failure in the job's store", exc_info=True)
        return None
    return first if first.get("rank") != rank and first.get("error") != json.loads(mine)["error"] else None


def abort_default_group(backend: str, release: Callable[[], None], first: bool) -> bool:
    """Abort (NCCL) and destroy every process group of this process; True when all were freed, which for gloo
    is what closes the connections its peers wait on. `release` drops the strategy's own holds on them;
    `first`: this rank's failure is the job's first and its own (a rank whose collective broke may still
    hold the broken group, in the error's traceback: nothing to warn about)."""
    import torch.distributed as dist

    if dist.is_initialized() and backend == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()  # ncclCommAbort on every communicator, before anything could wait on one
    release()
    freed = destroy_default_group()
    if not freed and first:
        log.warning(
            "fit() failed and kiln aborted the process group, but something outside kiln still holds it, so "
            "the other ranks may wait until the collective timeout (strategy.timeout)."
        )
    return freed
