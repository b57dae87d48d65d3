"""`apply_fsdp`: FSDP2 (`fully_shard`) over the mesh's data-parallel axes, on the wrapped blocks
(innermost first) and then the root, after tensor parallelism split what it splits (torchtitan's
order: FSDP shards the TP-split DTensors again over dp). Each rank then keeps 1/dp of every
parameter, gradient and optimizer state; a block's parameters are all-gathered just before it runs
and its gradients reduce-scattered, over a 1-D `dp_shard` mesh (ZeRO-3 / ZeRO-2), or a 2-D
`(dp_replicate, dp_shard)` one (HSDP: replicas of the sharded model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

from torch import nn

from kiln.strategies.process_group import register_group_user

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def is_fsdp(module: nn.Module) -> TypeGuard[FSDPModule]:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def apply_fsdp(
    root: nn.Module,
    blocks: list[nn.Module],
    dp_mesh: Any,
    *,
    reshard: bool,
    offload: bool,
    pin_memory: bool,
    mp_policy: Any | None,
    forward_prefetch: bool,
    direct_calls: bool = True,
) -> None:
    """Shard `blocks` (innermost first), then `root`, over `dp_mesh`, in place. A block or root that
    is an FSDP module already (a TrainingModule's `configure_model(mesh)` sharded it) is left as it is.
    `direct_calls`: the root's children gather its parameters when called from outside it
    (direct_calls.py); false where nothing calls them but the root (a pipeline stage's forward)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from kiln.strategies.mesh.direct_calls import gather_root_on_direct_calls

    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard,
        "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy(),
    }
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    units: list[FSDPModule] = []  # fully_shard turns a module into an FSDPModule in place and returns it
    for block in blocks:  # inner units first: fully_shard on the root then skips their parameters
        units.append(block if is_fsdp(block) else fully_shard(block, **kwargs))
    if not is_fsdp(root):
        fully_shard(root, **kwargs)
    if direct_calls:
        gather_root_on_direct_calls(root)  # model.generate() in a callback, model(x) after fit
    register_group_user(root, release_fsdp_groups)
    if forward_prefetch:
        for current, following in zip(units, units[1:]):
            current.set_modules_to_forward_prefetch([following])


def reshard_all(root: nn.Module) -> None:
    """Free every unit's gathered parameters (a forward without backward leaves them gathered when
    units do not reshard after forward)."""
    for unit in root.modules():
        if is_fsdp(unit):
            unit.reshard()


def release_fsdp_groups(module: nn.Module) -> None:
    """Drop the sharded module's hold on the process group at teardown (see destroy_default_group):
    FSDP2 keeps the group objects in each unit's mesh info, which live as long as the module does."""
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        for info in (getattr(group, "mesh_info", None), getattr(group, "post_forward_mesh_info", None)):
            for name in ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group"):
                if info is not None:
                    vars(info).pop(name, None)
