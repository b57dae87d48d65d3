"""Calls of the user's module that do not go through the set-up root, under FSDP2.

kiln shards the module it sets up: for a TrainingModule that is a parameterless wrapper (the engine's
step dispatcher) whose FSDP unit holds every parameter outside the wrapped blocks (embeddings, final
norm, head). The Trainer's loops call that root, whose hooks gather those parameters; a call of the
user's module itself — `model.generate(...)` in a callback, `model(x)` after `fit` — skips the root's
hooks and met sharded parameters ("got mixed torch.Tensor and DTensor"). Each direct child of the root
therefore gathers the root's parameters around a call made from outside the root's own forward, and
shards them again after it, with FSDP2's public `unshard`/`reshard`.

Like every FSDP forward, such a call is a collective when there is more than one rank: every rank
must make it (a callback that generates on rank 0 alone waits for the others forever)."""

from __future__ import annotations

from typing import Any

from torch import nn


def gather_root_on_direct_calls(root: nn.Module) -> None:
    """Hooks on `root` (an FSDP module) and its direct children that are not FSDP units themselves."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(root, FSDPModule):
        return
    children = [child for child in root.children() if not isinstance(child, FSDPModule)]
    if not children:
        return
    depth = [0]  # inside the root's forward (or a direct call already being served): nothing to do

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    def gather(*_: Any) -> None:
        if depth[0] == 0:
            root.unshard()
        depth[0] += 1

    def release(*_: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            root.reshard()

    root.register_forward_pre_hook(enter)
    root.register_forward_hook(leave, always_call=True)
    for child in children:
        child.register_forward_pre_hook(gather)
        child.register_forward_hook(release, always_call=True)
