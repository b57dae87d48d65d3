"""Activation memory of one training micro-batch, found by running the model's forward and backward on
fake tensors: `FakeTensorMode` (meta storage: shapes and dtypes, no data, no weights materialised)
under PyTorch's `MemTracker` (torch.distributed._tools), which follows every tensor's storage from its
creation to its release. So the figure is the model's own (any architecture, its real batch shape,
autocast's dtypes, kiln's activation checkpointing applied to its blocks), not a formula that knows one
architecture; the batch size and sequence length reach it through the batch, the hidden size and layer
count through the model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: mixed-precision plugins: the dtype autocast computes in
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "apex": torch.float16}
#: pure half precision: the weights themselves are cast
CAST = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}


@dataclass(frozen=True)
class Activations:
    """At the forward+backward peak: bytes of activations and temporaries (`peak`) and of the gradients
    alive at that moment (`grads`), the weights and buffers left out."""

    peak: int
    grads: int


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss the fit would backpropagate: a TrainingModule's training_step, else the model's `loss`."""
    from kiln.engine.model.module import TrainingModule

    if isinstance(model, TrainingModule):
        out = model.training_step(batch)
    else:
        out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    if isinstance(out, Mapping):
        return out["loss"]
    return out if isinstance(out, torch.Tensor) else out.loss


def trace(
    build: Callable[[], nn.Module],
    precision: str,
    prepare: Callable[[nn.Module], tuple[Any, contextlib.AbstractContextManager[Any]]],
) -> Activations:
    """Build the model with `build` on fake tensors, `prepare` it (the tp split, activation checkpointing;
    it returns the batch the model takes and the context the run wraps the micro-batch's forward and
    backward in: loss parallel's, as the mesh strategy's `micro_batch_context` enters it), and follow one
    forward and backward of that batch at `precision` inside that context."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.utils._pytree import tree_map

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = build()
        batch, around = prepare(model)
        if precision in CAST:
            model.to(CAST[precision])
        model.train()
        fake = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
        tracker = MemTracker()
        tracker.track_external(model)
        autocast = (
            torch.autocast("cpu", dtype=AUTOCAST[precision]) if precision in AUTOCAST else contextlib.nullcontext()
        )
        with tracker, _untracked_propagation(), around:
            with autocast:
                loss = loss_of(model, fake)
            loss.backward()
        snapshot = tracker.get_tracker_snapshot("peak")
    kinds = [_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH]
    return Activations(
        peak=sum(int(per.get(kind, 0)) for per in snapshot.values() for kind in kinds),
        grads=sum(int(per.get(_MemRefType.GRAD, 0)) for per in snapshot.values()),
    )


@contextlib.contextmanager
def _untracked_propagation() -> Iterator[None]:
    """DTensor's sharding propagation runs each op it derives an output's metadata for (the global shape)
    once more on fake tensors of the global shape, in the fake mode it finds active. In a run that mode is
    a fresh one, which MemTracker leaves out; under the trace's it is the trace's own, so MemTracker would
    count those global-size tensors as the rank's own: loss parallel's handlers (log-softmax, nll loss and
    its backward) derive theirs at the logits' peak, which made the split trace two logits larger than
    the run. Here the propagation runs with the trace's modes off (so in a fresh fake mode, as in a run)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:  # a torch that moved it: the trace runs, with loss parallel's saving undercounted
        yield
        return

    def untracked(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextlib.contextmanager
def fake_tp_mesh(tp: int) -> Iterator[Any]:
    """A DeviceMesh of `tp` ranks (one axis, `tp`) over torch's fake process group, in this one process: its
    collectives move nothing and return what one rank's would hold, so a model split over it and run on fake
    tensors shows one tp rank's memory. The group is ended on leaving. The caller checks that no process
    group exists already (the fake one would take its place)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", rank=0, world_size=tp, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()
