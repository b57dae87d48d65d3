"""What each micro-batch's forward and backward run inside on the mesh (MeshStrategy's
`micro_batch_context`, which the loop enters around both): FSDP reduce-scatters once per accumulation
window, on its last micro-batch; under cp the micro-batch runs inside torch's ring-attention dispatcher
(context_parallel.py; packed rows gather keys and values instead, packed_cp.py); with loss parallel
inside torch's `loss_parallel()` (loss_parallel.py); with both (cp x tp), inside both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


def micro_batch_contexts(strategy: Any, root: nn.Module, *, boundary: bool) -> contextlib.AbstractContextManager[Any]:
    """The contexts `strategy` (a MeshStrategy) runs one micro-batch of `root` (the unwrapped module) in;
    `boundary`: the window's last micro-batch, where FSDP's gradients are reduced."""
    from kiln.strategies.mesh.fsdp import is_fsdp

    if is_fsdp(root):
        root.set_requires_gradient_sync(boundary)
    contexts: list[contextlib.AbstractContextManager[Any]] = []
    if strategy.shape.cp > 1 and strategy.cp_packed:
        from kiln.strategies.mesh.packed_cp import gathered_attention

        contexts.append(gathered_attention(strategy.device_mesh["cp"]))
    elif strategy.shape.cp > 1:
        from kiln.strategies.mesh.context_parallel import ring_attention

        contexts.append(ring_attention(strategy.device_mesh["cp"], strategy.cp_load_balance))
    if strategy._loss_parallel is not None:
        contexts.append(strategy._loss_parallel.context())
    return _all_of(contexts)


@contextlib.contextmanager
def _all_of(contexts: list[contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
