"""The mesh strategy's sharded checkpoints written in the background (`save.async`): DCP's `async_save`.

At the step boundary every rank hands its shards of the model and optimizer state to `async_save`,
which copies them into host memory with the stager below and returns a future; DCP's writer thread
then writes the shards, fsyncs them, and the coordinator writes `.metadata`. The future resolves on
every rank only after the coordinator has heard from every rank that its files are written
(DCP's closing all-reduce), which is what lets the engine write COMPLETE once the writer's resolves.

The stager is kiln's `HostStaging` (kiln/utils/host_copy.py), kept for the run: each DTensor's local
shard is copied into a host buffer that the next save reuses (pinned when the shard is on a GPU), and
the copy is a DTensor of the same spec, which is all DCP's planner reads. DCP's own `DefaultStager`
does not keep its buffers on every torch: torch 2.11's empties its type table and its cached storages
after each stage, so a kept one failed at the second save (`KeyError: <class 'type'>`) and a fresh one
per save pinned the whole state again each time (on an H200, 0.45 s of a 1.5 s synchronous save, for
1.2 GB of state).

The writer thread runs DCP's collectives (plan, gather, finish) while the training thread runs its
own (FSDP's all-gathers): they go over a gloo group of their own, made once per process group at the
first asynchronous save (`new_group` is a collective; every rank stages at the same step). DCP's
process-based executor (`AsyncCheckpointerType.PROCESS`) would start a second process per rank with a
process group of its own and copy the state once more into shared memory; the thread writes the same
files without that, on CPU (gloo) and CUDA alike."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kiln.utils.errors import CheckpointError
from kiln.utils.host_copy import HostStaging


class HostStager:
    """DCP's stager protocol (`torch.distributed.checkpoint.staging.AsyncStager`) over `HostStaging`:
    `stage` returns the finished host copy, so DCP has nothing to wait for after starting its write."""

    _synchronize_after_execute = False  # the protocol's attribute, read through the property below
    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self.staging = HostStaging()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        copied: dict[str, Any] = self.staging.copy(state_dict)
        return copied

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copies before it returns."""

    def close(self) -> None:
        self.staging = HostStaging()  # the host buffers go with the old one


class AsyncDCPSaver:
    """One process's `async_save`s: its checkpoint process group and its stager, both made once."""

    def __init__(self) -> None:
        self._group: Any = None
        self._stager = HostStager()

    def save(self, state: dict[str, Any], path: str) -> Future[Any]:
        """Stage `state` now and write it to the DCP folder `path` on DCP's thread; the future resolves
        when every rank's files are written (and raises DCP's CheckpointException if any rank's failed)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # a collective: every rank is here at the same save
        future = dcp.async_save(
            state,
            checkpoint_id=path,
            process_group=self._group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self._stager,
        )
        assert isinstance(future, Future)  # a stager that stages synchronously gives the upload's future
        return future

    def close(self) -> None:
        """Let the staged host copies go (the process group goes with the default group's teardown)."""
        self._stager.close()
        self._group = None


def finished(future: Future[Any]) -> None:
    """Wait for an `async_save`; a failure is raised as the first failing rank's own exception (an
    OSError keeps its errno for the engine's one sentence), not DCP's BaseException wrapper."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        future.result()
    except CheckpointException as err:
        failures = err.failures  # rank -> (its exception, its traceback)
        cause = failures[min(failures)][0] if failures else None
        if isinstance(cause, Exception):
            raise cause from None
        raise CheckpointError(
            f"The background write of torch.distributed.checkpoint was interrupted on rank(s) {sorted(failures)} "
            f"({type(cause).__name__})."
        ) from None
