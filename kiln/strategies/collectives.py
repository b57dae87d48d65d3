"""`ProcessGroupCollectives`: what every strategy with one process per device shares, as a mixin --
the topology the launcher gives (world size, ranks, each rank's device), torch.distributed's default
group (created in `setup_environment`, destroyed in `teardown` when this strategy made it), and the
five collectives of the Strategy contract over that group.

DDP, DeepSpeed and the mesh strategy (`fsdp`, `model_parallel`) inherit it before `Strategy`, as a
one-process strategy inherits `SingleProcessCollectives`:

    class MyStrategy(ProcessGroupCollectives, Strategy): ...

A strategy whose ranks are not all distinct data (the tensor-parallel ranks of one data shard) narrows
`reduce` and `all_gather` in its own mixin (kiln/strategies/mesh/collectives.py); the plain ones here span
every rank. Creating, naming and freeing the group itself is kiln/strategies/process_group.py."""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kiln.launch.environment import detect
from kiln.strategies import abort
from kiln.strategies.process_group import (
    barrier,
    default_backend,
    destroy_default_group,
    init_process_group,
    keep_default_store,
    pick_device,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)

#: the reductions `reduce` takes
OPS = ("sum", "mean", "max", "min")


class ProcessGroupCollectives:
    """One process per device over torch.distributed's default group (see the module docstring).
    Inherit it before `Strategy`; it sets `cluster`, the ranks, `backend` and the device."""

    name: ClassVar[str]
    config: DictConfig
    world_size: int
    global_rank: int
    _wrapped: Any
    _source: Any
    aborted: bool

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        super().__init__(config, precision)  # type: ignore[call-arg]  # Strategy.__init__, next in the MRO
        self.cluster = detect()
        self.world_size = self.cluster.world_size
        self.global_rank = self.cluster.rank
        self.local_rank = self.cluster.local_rank
        self.node_rank = self.cluster.node_rank
        self._device = pick_device(self.cluster, config.strategy.device)
        self.backend: str = config.strategy.backend or default_backend(self._device)
        self._owns_group = False

    @property
    def root_device(self) -> torch.device:
        return self._device

    def setup_environment(self) -> None:
        """Make this rank's device current and create the default group (or join the one the user,
        or another Trainer, made: it then decides the world size and rank)."""
        import torch.distributed as dist

        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        if init_process_group(self.cluster, self.backend, self.config.strategy.timeout):
            self._owns_group = True
            atexit.register(self.teardown)  # evaluate/predict may follow fit, so not before exit
            if not self.cluster.launched:
                log.warning(
                    "strategy %r without a launcher runs one process; start several with "
                    "`kiln fit --nproc N`, torchrun or accelerate launch.",
                    self.name,
                )
        else:
            self.world_size, self.global_rank = dist.get_world_size(), dist.get_rank()

    # -- collectives ------------------------------------------------------------------------
    def _comm(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy on the device the backend communicates from (NCCL: the GPU)."""
        device = self._device if self.backend == "nccl" else tensor.device
        return tensor.detach().to(device, copy=True).contiguous()

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        import torch.distributed as dist

        check_op(op)
        t = self._comm(torch.as_tensor(tensor))
        if op == "mean" and not t.is_floating_point():
            t = t.double()
        dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM))
        if op == "mean":
            t = t / self.world_size
        return t.to(torch.as_tensor(tensor).device)

    def reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        import torch.distributed as dist

        if op != "sum":  # only sums are needed in the background; the others take the plain path
            done = self.reduce(tensor, op)
            return lambda: done
        t = self._comm(torch.as_tensor(tensor))
        work = dist.all_reduce(t, async_op=True)
        device = torch.as_tensor(tensor).device

        def wait() -> torch.Tensor:
            work.wait()
            return t.to(device)

        return wait

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = self._comm(tensor)
        is_bool = t.dtype == torch.bool
        if is_bool:  # gloo has no bool collectives
            t = t.to(torch.uint8)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        out = torch.stack(parts)
        return (out.bool() if is_bool else out).to(tensor.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self, name: str | None = None) -> None:
        barrier(self._device, self.backend)

    def fit_failed(self, error: BaseException, fit_call: int) -> dict[str, Any] | None:
        """Agree with the other ranks on this failed fit() call; unless every rank failed, abort the groups,
        whoever made them, after dropping this strategy's holds on them (its subclasses' `teardown`): the
        peers must stop (kiln/strategies/abort.py)."""
        if self.world_size <= 1:
            return None
        decision, first = abort.fit_failed(self.global_rank, self.world_size, fit_call, error)
        if decision == "kept":
            return None
        keep_default_store()  # a store this rank hosts keeps answering the peers after the group is gone

        def release() -> None:  # teardown drops the holds (and destroys the group if this strategy made it)
            self.teardown()
            self._wrapped = self._source = None

        own = decision == "abort" and first is None and not isinstance(error, RuntimeError)  # warn of a held group
        abort.abort_default_group(self.backend, release, first=own)
        self.aborted = True
        return first if decision == "stopped" else None

    def teardown(self) -> None:
        """Destroy the process group if this strategy created it (idempotent)."""
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            self._wrapped = self._source = None
            if not destroy_default_group() and self.backend == "gloo":
                # Something outside kiln still holds the group, so its gloo workers outlive it: yield
                # briefly while the interpreter is whole so they finish releasing the last collective's
                # tensors (see destroy_default_group). Not reached by kiln's own wrappers.
                log.debug("the process group outlives destroy_process_group (referenced elsewhere)")
                time.sleep(0.1)
        self._owns_group = False


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"reduce op must be one of {', '.join(OPS)}, got {op!r}.")
