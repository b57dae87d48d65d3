"""fp16's loss scaler under the mesh strategy: torch's ShardedGradScaler, unscaling local tensors.

Imported only when an fp16 run needs it: torch's module binds the default process group as a default
argument of `ShardedGradScaler.__init__` when it is first imported, and imported after the group
exists that binding would keep the group alive past teardown (see process_group.destroy_default_group)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class ShardedLocalGradScaler(ShardedGradScaler):
    """torch's ShardedGradScaler (the inf found on any rank is all-reduced, so every rank skips the
    step together), unscaling each gradient's local tensor. One foreach kernel cannot take DTensors
    beside plain tensors, which is what tensor parallelism without FSDP leaves (split layers beside
    whole norms); unscaling is elementwise, so unscaling the local shards is unscaling the DTensors.

    Its found-inf flags are 0-d, as torch's GradScaler keeps them (ShardedGradScaler makes them shape
    [1]): a fused optimizer (Adam's `fused=True`) subtracts the flag from its 0-d step counters, which a
    [1]-shaped flag breaks after an unscale for clipping ("output with shape [] doesn't match the
    broadcast shape [1]")."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                    grads[(local.device, local.dtype)].append(local)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                if device not in found:
                    found[device] = found_inf.to(device=device, copy=True).reshape(())
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv_scale.to(device))
        return found or {found_inf.device: found_inf.clone().reshape(())}  # a rank without gradients still takes part

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A fused optimizer's step (Adam's `fused=True`) reads the infs through this, without an `unscale_`
        first when nothing clips; torch's ShardedGradScaler all-reduces them only in `unscale_`, so a rank whose
        gradients were finite stepped while the others skipped. They are all-reduced here too, as there."""
        import torch.distributed as dist

        found = super()._check_inf_per_device(optimizer)
        pending = []
        for flag in found.values():
            moved = flag.to(self._device) if self._device != "cpu" and flag.device.type == "cpu" else flag
            pending.append((flag, moved, dist.all_reduce(moved, async_op=True, group=self.process_group)))
        for flag, moved, work in pending:
            work.wait()
            if moved is not flag:
                flag.copy_(moved)
        return found
