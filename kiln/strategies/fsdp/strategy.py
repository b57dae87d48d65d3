"""`strategy: fsdp`: Fully Sharded Data Parallel on PyTorch's FSDP2 (`fully_shard`, DTensor
parameters). Each rank keeps 1/world of the parameters, gradients and optimizer state; a block's
parameters are all-gathered just before it runs and freed after, gradients are reduce-scattered.

The process group, device choice and collectives are DDP's (one process per device, started by a
launcher); what differs is `setup_module` (fully_shard on the auto-wrap blocks, then on the root),
the step (clipping over DTensor gradients, no reduce-scatter inside an accumulation window),
export (the full state dict gathered to rank 0) and checkpoints (fsdp_checkpoint_io.py).

Settings come from kiln's own keys, HF's `fsdp` / `fsdp_config` or accelerate's FSDP config; see
fsdp_options.py. Sharding maps to FSDP2 like this: full_shard = 1-D mesh, reshard after forward;
shard_grad_op = the same without resharding after forward (ZeRO-2); no_shard = a (world, 1) mesh
(replicate only, DDP's maths); hybrid_shard(_zero2) = a (world / shard_size, shard_size) mesh that
shards inside a node and replicates across nodes.

The loss weights are DDP's: FSDP2 divides the reduced gradients by the world size, like DDP."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Optional

import torch
from torch import nn

from kiln.strategies import STRATEGIES
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.ddp.strategy import DDPStrategy
from kiln.strategies.interfaces import CompilesPerBlock, ShardedModuleInit
from kiln.strategies.process_group import register_group_user
from kiln.strategies.fsdp.options import NATIVE, FSDPSettings, resolve
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)


@STRATEGIES.register("fsdp", "fsdp2")
class FSDPStrategy(DDPStrategy, ShardedModuleInit, CompilesPerBlock):
    name = "fsdp"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        precisions=frozenset({"fp32", "tf32", "bf16", "fp16", "bf16-true", "fp16-true"}),
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        reasons={"mps": "FSDP needs gloo or NCCL collectives and DTensor support, which Apple GPUs do not have "
                        "(one MPS device: strategy mps)",
                 "xla": "XLA devices shard through XLA's own FSDP (use strategy xla_fsdp)",
                 "apex": "apex's amp cannot handle FSDP's sharded DTensor parameters; use precision: bf16 or fp16"},
    )
    options = dict(NATIVE)
    checkpoint_formats = ("fsdp-sharded", "fsdp-full")  # strategy.state_dict_type: sharded (default) or full

    def __init__(self, config: "DictConfig", precision: "Precision") -> None:
        super().__init__(config, precision)
        self.settings: FSDPSettings = resolve(self.option)
        for key, why in self.settings.no_effect.items():
            log.warning("FSDP setting %r has no effect: %s.", key, why)
        if self.settings.offload and self.settings.offload_pin_memory and self.root_device.type == "cpu":
            raise ConfigError("FSDP offload with pinned memory needs an accelerator, but this run is on the CPU; "
                              "set strategy.offload_pin_memory: false (or run on a GPU).")
        self._mp_policy: Any = None
        self._root: Optional[nn.Module] = None

    # -- set-up -----------------------------------------------------------------------------
    def connect_precision(self, precision: "Precision") -> "Precision":
        """Mixed precision (autocast) becomes FSDP's MixedPrecisionPolicy: parameters are gathered in
        the compute dtype, gradients reduced in fp32; fp16 keeps its loss scale with the sharded
        scaler. True half precision needs nothing: the half parameters are what gets sharded."""
        from kiln.strategies.fsdp.precision import fsdp_precision

        self.precision, self._mp_policy = fsdp_precision(precision, self.root_device)
        return self.precision

    def module_init_context(self) -> ContextManager[Any]:
        """cpu_ram_efficient_loading: a model the Trainer builds exists in full on rank 0 only; the
        other ranks build it on the meta device and receive their shards in `setup_module`."""
        from kiln.strategies.fsdp.loading import built_on_rank0

        if self.settings.cpu_ram_efficient_loading and self.world_size > 1:
            return built_on_rank0(self.global_rank, self.root_device)
        return contextlib.nullcontext()

    def mesh(self) -> Any:
        """The device mesh for the sharding option (1-D, or 2-D (replicate, shard) for hybrid/no_shard)."""
        from torch.distributed.device_mesh import init_device_mesh

        world, s = self.world_size, self.settings
        if s.sharding in ("full_shard", "shard_grad_op"):
            return init_device_mesh(self.root_device.type, (world,))
        if s.sharding == "no_shard":
            shard = 1
        else:
            shard = s.shard_size or self.cluster.local_world_size or world
            if shard < 1 or world % shard:
                raise ConfigError(f"{s.sharding} needs the world size ({world}) to be a multiple of the shard group size "
                                  f"({shard}); set strategy.shard_size to a divisor of {world}.")
        return init_device_mesh(self.root_device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from kiln.strategies.fsdp.loading import has_meta_tensors, rank0_parameters, scatter_from_rank0
        from kiln.strategies.fsdp.compile import compile_units
        from kiln.strategies.fsdp.direct_calls import gather_root_on_direct_calls
        from kiln.strategies.fsdp.wrap import apply_activation_checkpointing, blocks_to_wrap, sync_module_states

        s = self.settings
        on_meta = has_meta_tensors(module)
        if on_meta and (self.is_global_zero or not s.cpu_ram_efficient_loading):
            raise ConfigError("The model has parameters on the meta device; build it with real weights, or let "
                              "the Trainer build it (model_init) with strategy.cpu_ram_efficient_loading: true.")
        if not on_meta:
            module = module.to(self.root_device)
        efficient = s.cpu_ram_efficient_loading and self.world_size > 1
        if efficient:  # rank 0's values are sent shard by shard after sharding
            full = rank0_parameters(module) if self.is_global_zero else {}
        elif s.sync_module_states and self.world_size > 1:
            sync_module_states(module)
        blocks = blocks_to_wrap(module, s.wrap, s.min_num_params)
        if s.activation_checkpointing:
            apply_activation_checkpointing(blocks)
        # torchtitan's order: checkpointing, compile, fully_shard (no blocks: the root's forward)
        compiled = compile_units(blocks or [module], self.config.train) if self.config is not None else 0
        pin = self.accelerator.pin_memory if s.offload_pin_memory is None else s.offload_pin_memory
        offload = CPUOffloadPolicy(pin_memory=pin) if s.offload else OffloadPolicy()
        mesh = self.mesh()
        register_group_user(mesh, _release_mesh_groups)
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": s.reshard, "offload_policy": offload}
        if self._mp_policy is not None:
            kwargs["mp_policy"] = self._mp_policy
        for block in blocks:  # inner units first: fully_shard on the root then skips their parameters
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)
        gather_root_on_direct_calls(module)  # model.generate() in a callback, model(x) after fit
        register_group_user(module, _release_groups)
        if efficient:
            if on_meta:  # only this rank's shards are materialised
                module.to_empty(device="cpu" if s.offload else self.root_device)
            scatter_from_rank0(module, full, self.root_device)
            del full
        if s.forward_prefetch:
            for current, following in zip(blocks, blocks[1:]):
                current.set_modules_to_forward_prefetch([following])
        log.info("FSDP: %s over %d process(es), %d wrapped block(s)%s%s%s.", s.sharding, self.world_size, len(blocks),
                 ", CPU offload" if s.offload else "", ", activation checkpointing" if s.activation_checkpointing else "",
                 f", {compiled} compiled forward(s)" if compiled else "")
        self._root = module
        return module

    def unwrap(self, model: nn.Module) -> nn.Module:
        """fully_shard changes the module in place: the wrapped module is the user's module."""
        return getattr(model, "_orig_mod", model)

    @contextlib.contextmanager
    def eval_cast_context(self, module: nn.Module, dtype: Optional[torch.dtype]) -> Iterator[None]:
        """Around one evaluation. With `shard_grad_op` (no resharding after forward) a forward without a
        backward leaves every unit's parameters gathered, and nothing reshards them: the optimizer then
        updates the shards while later forwards keep reading the stale gathered copies (an evaluation
        after training reported the untrained loss). So every unit is resharded when the evaluation ends."""
        with super().eval_cast_context(module, dtype):
            try:
                yield
            finally:
                root = self._root  # the set-up module (a TrainingModule's StepDispatcher)
                if not self.settings.reshard and root is not None:
                    from torch.distributed.fsdp import FSDPModule

                    for unit in root.modules():
                        if isinstance(unit, FSDPModule):
                            unit.reshard()

    # -- step -------------------------------------------------------------------------------
    def micro_batch_context(self, model: nn.Module, *, boundary: bool) -> ContextManager[Any]:
        """Inside an accumulation window gradients accumulate unsharded-reduced on each rank; the
        reduce-scatter runs once, on the window's last micro-batch."""
        root = self.unwrap(model)
        if not hasattr(root, "set_requires_gradient_sync"):
            return contextlib.nullcontext()
        root.set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The true global norm: each rank's norm over its gradient shards is a partial result that
        DTensor reduces over the mesh (`full_tensor`); then every shard is scaled by the same factor."""
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, None)
        return total

    def probe_module(self, model: nn.Module) -> nn.Module:  # never called: capabilities.auto_batch_size is False
        raise NotImplementedError("auto_find_batch_size is not supported with strategy 'fsdp'.")

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.fsdp.checkpoint_io import FullFSDPCheckpointIO, ShardedFSDPCheckpointIO

        cls = ShardedFSDPCheckpointIO if self.settings.state_dict_type == "sharded" else FullFSDPCheckpointIO
        return cls(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights with the module's own key names, gathered on CPU. Only rank 0 receives
        them (the others get an empty dict) unless every node writes (save.on_each_node)."""
        from kiln.strategies.fsdp.checkpoint_io import full_model_state

        every_rank = bool(self.config.save.on_each_node) if self.config is not None else False
        return full_model_state(self.unwrap(module), every_rank=every_rank)


def _release_groups(module: nn.Module) -> None:
    """Drop the sharded module's hold on the process group at teardown (see destroy_default_group):
    FSDP2 keeps the group objects in each unit's mesh info, which live as long as the module does."""
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        for info in (getattr(group, "mesh_info", None), getattr(group, "post_forward_mesh_info", None)):
            for name in ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group"):
                if info is not None:
                    vars(info).pop(name, None)


def _release_mesh_groups(mesh: Any) -> None:
    """A DeviceMesh keeps its groups in a registry of its own (torch >= 2.9); the module's DTensors
    keep the mesh."""
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
