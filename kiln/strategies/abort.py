"""Stopping the other ranks when `fit()` fails on one (issue 57): agree first (`agree`), then abort
(`abort_default_group`).

A rank whose fit raises used to stop its peers only by dying: its sockets closed with the process, and a
peer's pending collective failed then. A script that catches the error and keeps its process alive kept
the peers waiting in their next all-reduce or pipeline receive until the collective timeout (30 minutes by
default). But an error that every rank raises (a refusal of a checkpoint, an injected crash) leaves nobody
waiting, and a script may then fit again in the same processes: the group must stay. So the ranks agree
first, in the job's store, under a key of this fit() call (`FitKeys`):

- A rank whose fit raised first looks for a rank that aborted the group already (`FitKeys.aborted`): found,
  its own error is that abort breaking its collective, and it stops at once, naming that rank (`RankFailed`).
- Otherwise it counts itself (`store.add`) and waits up to `GRACE_S` seconds for every rank to count. All
  counted (all failed, alike or not): nothing is aborted, each rank raises its own error and the group
  stays usable. The grace expired with fewer counted: the rank records {rank, error} and aborts.
- One verdict per fit() call (`compare_set` on `FitKeys.verdict`, first wins): the last rank to count
  writes "kept", a rank whose grace expired writes its record, and every rank follows what was written, so
  a rank counting just after another's grace expired aborts with it rather than keep a dead group.

The abort: gloo has no working abort (in torch 2.13 `ProcessGroup.abort()` and `shutdown()` leave its
connections open: measured, a peer's pending all-reduce or `recv` waited until the failing process exited),
but a freed group closes its connections, and a peer's pending or next collective then fails at once
("Connection closed by peer"; measured ~0 s after `destroy_process_group`). So the group is destroyed, and
the strategy drops what holds it (its wrapper, mesh, pipeline stages, DeepSpeed's engine), so that it is
freed while the user's script still holds the Trainer and the exception. NCCL: `_abort_process_group()`
first, which calls ncclCommAbort on every communicator (a kernel in flight is cancelled rather than waited
for); the peers' NCCL watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, set by torchrun) then fails their
collectives. A store this rank hosts (no launcher agent: rank 0 hosts it) is kept alive, so that the peers
can still read the record.

After the abort this process has no process group: collectives, `evaluate` and a second `fit` cannot run
in it; a new fit needs a new process."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kiln.strategies.process_group import default_store, destroy_default_group, group_incarnation

log = logging.getLogger(__name__)

#: seconds a rank whose fit() raised waits for every other rank's fit() to raise too before it aborts the
#: process group (the peers then stop within this much of the failure); tests shorten it
GRACE_S = 10.0
#: seconds between two reads of the count while waiting
POLL_S = 0.02
#: the verdict of a fit() call that failed on every rank: nothing aborted
KEPT = "kept"


@dataclass(frozen=True)
class FitKeys:
    """The store keys of one fit() call: the ranks count their failures under `failed`, one `verdict` is
    written (KEPT or the aborting rank's record), and `aborted` holds the first record of a rank that
    aborted this incarnation of the default group (any fit() call), which a peer stopped by it reads."""

    failed: str
    verdict: str
    aborted: str

    @classmethod
    def of(cls, fit_call: int, incarnation: int) -> FitKeys:
        """The keys of this process's `fit_call`-th fit() (counted from 0: ranks call fit() alike) on the
        `incarnation`-th default group kiln made in it."""
        group = f"kiln/fit/{incarnation}"
        return cls(f"{group}/{fit_call}/failed", f"{group}/{fit_call}/verdict", f"{group}/aborted")


#: what `agree` decided: "stopped" (another rank aborted already: this rank's error followed from it),
#: "kept" (every rank failed: nothing to abort) or "abort"
Decision = Literal["stopped", "kept", "abort"]


def record(rank: int, error: BaseException) -> str:
    """{"rank", "error": "Type: message"} as the store holds it."""
    return json.dumps({"rank": rank, "error": f"{type(error).__name__}: {error}"[:2000]})


def agree(
    store: Any, keys: FitKeys, rank: int, world_size: int, error: BaseException, grace_s: float | None = None
) -> tuple[Decision, dict[str, Any] | None]:
    """This rank's fit() raised `error`: decide with the other ranks whether to abort the group (see the
    module's docstring). Returns the decision and the record of the rank that aborted (None when kept, and
    when this rank is that rank)."""
    if store.check([keys.aborted]):
        return "stopped", json.loads(store.get(keys.aborted))
    mine = record(rank, error)
    counted = store.add(keys.failed, 1)
    deadline = time.monotonic() + (GRACE_S if grace_s is None else grace_s)
    while counted < world_size and time.monotonic() < deadline:
        time.sleep(POLL_S)
        counted = store.add(keys.failed, 0)
    verdict = store.compare_set(keys.verdict, "", KEPT if counted >= world_size else mine).decode()
    if verdict == KEPT:
        return "kept", None
    first = json.loads(store.compare_set(keys.aborted, "", verdict))
    return "abort", None if first["rank"] == rank else first


def fit_failed(
    rank: int, world_size: int, fit_call: int, error: BaseException
) -> tuple[Decision, dict[str, Any] | None]:
    """`agree` on the default group's store; "abort" when there is no store to agree in (the peers cannot be
    told otherwise) or it no longer answers (its host died: the group is broken anyway)."""
    store = default_store()
    if store is None:
        return "abort", None
    try:
        return agree(store, FitKeys.of(fit_call, group_incarnation()), rank, world_size, error)
    except Exception:  # noqa: BLE001 - a store that no longer answers
        log.debug("could not agree on the failed fit in the job's store", exc_info=True)
        return "abort", None


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
