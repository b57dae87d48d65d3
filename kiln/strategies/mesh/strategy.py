"""The one sharding strategy: every process on one named DeviceMesh (dims.py: dp_replicate, dp_shard,
cp, tp; pp and ep in their own subclasses, pipeline.py and expert_parallel.py), each parallelism
applied to the model by its own `apply_*` function, in torchtitan's order:

    tensor parallel      apply_tp (tp_plan.py; sequence_parallel.py, loss_parallel.py)  over `tp`
                         -- or the TrainingModule's own `configure_model(mesh)`
    activation ckpt      apply_activation_checkpointing (../activation_checkpointing.py) on the wrapped blocks
    compile              compile_units (../regional_compile.py)                         each block's forward
    FSDP2                apply_fsdp (fsdp.py)                                           over dp (x cp)
    context parallel     context_parallel.py (packed rows: packed_cp.py), at the batch and
                         micro-batch seams                                            over `cp`

and one DCP checkpoint IO (checkpoint_io.py). `strategy: fsdp` and `strategy: model_parallel` are two
presets of it (kiln/strategies/fsdp/, kiln/strategies/model_parallel/): they differ only in how the
mesh is written and in one default (`sync_module_states`), so every feature works under both or is refused under both in
the same sentence (`_check_settings`).

FSDP2 runs over the dp axes whenever they (with cp) hold more than one rank, and on one rank too when
no tp axis splits the model (`ParallelDims.fsdp`). With tp alone the model is split, not sharded.

Sizes: the `cp * tp` ranks of one data shard read the same batches, so the sampler sees
`data_shards = dp_replicate * dp_shard` replicas. Under cp each rank then keeps its own chunk of those
sequences (`batch_to_device`), so `item_shards = dp_replicate * dp_shard * cp` ranks hold distinct
tokens. FSDP2 divides the reduced gradients by the size of its mesh, dp x cp, so `grad_divisor` is it.
What sums and means count, and which entries the gathers keep, is MeshCollectives' (collectives.py), over
ProcessGroupCollectives' process group (one process per device); what the settings cannot do on a mesh is
refused by setting_checks.py."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.strategies.base import Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.interfaces import BackwardSyncControl, ShardedModuleInit
from kiln.strategies.mesh.async_dcp import AsyncDCPSaver
from kiln.strategies.mesh.collectives import MeshCollectives
from kiln.strategies.mesh.dims import (
    ParallelDims,
    build_device_mesh,
    dp_mesh,
    flatten_axes,
    parse_mesh,
    release_mesh_groups,
)
from kiln.strategies.mesh.micro_batch import micro_batch_contexts
from kiln.strategies.mesh.setting_checks import check_cp, check_settings
from kiln.strategies.mesh.settings import MeshSettings
from kiln.strategies.process_group import register_group_user
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)


class MeshStrategy(MeshCollectives, Strategy, BackwardSyncControl, ShardedModuleInit):
    """The mesh strategy's whole behaviour; a preset supplies `read_settings` and `mesh_request`
    (and its names, options and defaults)."""

    name = "mesh"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        precisions=frozenset({"fp32", "tf32", "bf16", "fp16", "bf16-true", "fp16-true", "fp8"}),
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        compiles_per_block=True,  # each block's forward before the tp split and `fully_shard`, as torchtitan
        reasons={
            "mps": "it needs gloo or NCCL collectives and DTensor support, which Apple GPUs do not have "
            "(one MPS device: strategy mps)",
            "xla": "XLA devices shard through XLA's own FSDP and SPMD (use strategy xla_fsdp)",
            "apex": "apex's amp cannot handle FSDP's or tensor parallelism's DTensor parameters; use precision: bf16 "
            "or fp16",
            "mxfp8": "MXFP8 layers are not wired into FSDP2 or tensor parallelism yet; use strategy single or ddp "
            "with precision: mxfp8, or precision: fp8 here",
        },
    )
    checkpoint_formats = ("fsdp-sharded", "fsdp-full")  # strategy.state_dict_type: sharded (default) or full
    settings: MeshSettings

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        super().__init__(config, precision)
        self.settings = self.read_settings()
        self._checkpointed = 0  # blocks setup_activation_checkpointing checkpointed (for the set-up log line)
        self.shape: ParallelDims = self.parallel_dims(self.world_size)
        self._check_settings()
        self.device_mesh: Any = None
        self._cp_rank = 0
        self._dp_group: Any = None
        self._root: nn.Module | None = None
        self._mp_policy: Any = None
        self._loss_parallel: Any = None  # loss_parallel.LossParallel once the head keeps split logits
        self._async_checkpoints: AsyncDCPSaver | None = None  # save.async's DCP group and stager, once made

    # -- what a preset supplies ----------------------------------------------------------------
    def read_settings(self) -> MeshSettings:
        """The shared settings, from however the preset's config writes them."""
        raise NotImplementedError

    def mesh_request(self, world_size: int) -> dict[str, int] | None:
        """The mesh the preset asks for on `world_size` processes, as `strategy.mesh` would write it
        (None: `{dp_shard: -1}`)."""
        raise NotImplementedError

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return parse_mesh(self.mesh_request(world_size), world_size)

    # -- topology ---------------------------------------------------------------------------
    @property
    def data_shards(self) -> int:
        return self.shape.dp

    @property
    def data_shard_rank(self) -> int:
        return self.shape.data_rank(self.global_rank)

    @property
    def item_shards(self) -> int:
        return self.shape.dp_cp

    @property
    def grad_divisor(self) -> int:
        return self.shape.dp_cp

    @property
    def cp_load_balance(self) -> bool:
        """Whether cp splits sequences in torch's head-tail order (model_parallel's option, default true)."""
        value = self.option("cp_load_balance", True)
        if not isinstance(value, bool):
            raise ConfigError(f"strategy.cp_load_balance is {value!r}; give true or false.")
        return value

    @property
    def cp_packed(self) -> bool:
        """Whether training rows are packed (data.packing): cp then attends with gathered keys and
        values and a per-example mask (packed_cp.py) instead of the ring, which takes no mask."""
        packing = getattr(getattr(self.config, "data", None), "packing", None)
        return packing is not None and (packing.strategy is not None or bool(packing.padding_free))

    # -- checks, before any process group starts ------------------------------------------------
    def _check_settings(self) -> None:
        """What the settings cannot do on this mesh, refused in one sentence each, the same sentence
        under both presets (mesh/setting_checks.py)."""
        check_settings(self.settings, self.shape, self.root_device.type, self.precision.name, self.config)
        self._check_cp_config()

    def _check_cp_config(self) -> None:
        """What cp has not been made to work with, refused before any process group starts."""
        if self.shape.cp == 1 or self.config is None:
            return
        _ = self.cp_load_balance  # a wrong value fails here, not at the first batch
        check_cp(self.config.train)

    # -- set-up -----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.device_mesh is not None:
            return
        self.shape = self.parallel_dims(self.world_size)  # a group made outside kiln sets the world
        self._check_settings()
        self.device_mesh = build_device_mesh(self.shape, self.root_device.type)
        register_group_user(self.device_mesh, release_mesh_groups)
        # flattened mesh axes: their groups are the mesh's own (same backend, released with it)
        self._dp_group = flatten_axes(
            self.device_mesh, self.shape
        )  # with tp: the ranks of my TP position with other data
        self._cp_rank = self.device_mesh["cp"].get_local_rank()
        log.info("%s: %s over %d process(es).", self.name, self.shape.describe(), self.world_size)

    def connect_precision(self, precision: Precision) -> Precision:
        """Where FSDP shards the model, mixed precision (autocast) becomes FSDP's MixedPrecisionPolicy
        (parameters, TP-split ones included, gathered in the compute dtype, gradients reduced in fp32);
        with tp alone autocast stays. fp16's loss scale is kept by a scaler whose inf check spans every
        rank (mesh/precision.py). True half precision needs nothing."""
        from kiln.strategies.mesh.precision import mesh_precision

        precision, self._mp_policy = mesh_precision(precision, self.root_device, self.shape.fsdp)
        return super().connect_precision(precision)

    def module_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """cpu_ram_efficient_loading: a model the Trainer builds exists in full on rank 0 only; the
        other ranks build it on the meta device and receive their shards in `setup_module`."""
        from kiln.strategies.mesh.loading import built_on_rank0

        if self.settings.cpu_ram_efficient_loading and self.world_size > 1:
            return built_on_rank0(self.global_rank, self.root_device)
        return contextlib.nullcontext()

    def setup_activation_checkpointing(self, module: nn.Module) -> list[nn.Module]:
        """The config's activation_checkpointing on the blocks FSDP wraps; the strategy's own
        `activation_checkpointing: true` (HF's fsdp_config key) is an alias of mode full."""
        from kiln.strategies.activation_checkpointing import checkpoint_model, find_blocks, policy

        s = self.settings
        chosen = policy(self.config, strategy_flag=s.activation_checkpointing)
        blocks = find_blocks(module, s.wrap, s.min_num_params) if chosen else []
        checkpointed = checkpoint_model(module, chosen, blocks)
        self._checkpointed = len(checkpointed)
        return checkpointed

    def setup_compile_regions(self, module: nn.Module) -> int:
        """Nothing yet: the mesh compiles the blocks FSDP wraps in `setup_module`, after the tp split and before
        `fully_shard` (torchtitan's order), whether `torch_compile.regions` is blocks or unset."""
        return 0

    def setup_module(self, module: nn.Module) -> nn.Module:
        from kiln.config.compile import compiles_blocks
        from kiln.strategies.mesh.context_parallel import check_model
        from kiln.strategies.mesh.fsdp import apply_fsdp
        from kiln.strategies.mesh.loading import (
            has_meta_tensors,
            rank0_parameters,
            scatter_from_rank0,
            sync_module_states,
        )
        from kiln.strategies.mesh.presharded import is_loaded_split
        from kiln.strategies.mesh.tp_plan import user_module
        from kiln.strategies.regional_compile import compile_blocks, compile_units
        from kiln.strategies.wrap_policy import blocks_to_wrap

        s, dims = self.settings, self.shape
        if dims.cp > 1:  # before any work: attention CP cannot shard is refused here
            check_model(module, self.root_device.type, self.cp_packed)
        on_meta = has_meta_tensors(module)
        if on_meta and (self.is_global_zero or not s.cpu_ram_efficient_loading):
            raise ConfigError(
                "The model has parameters on the meta device; build it with real weights, or let "
                "the Trainer build it (model_init) with strategy.cpu_ram_efficient_loading: true."
            )
        if self.device_mesh is None:
            self.setup_environment()
        dims, mesh = self.shape, self.device_mesh  # the mesh of the world the group has
        if not on_meta:
            module = module.to(self.root_device)
        user = user_module(module)
        loaded_split = is_loaded_split(user)  # split by transformers at load: its DTensors stay as they are
        efficient = s.cpu_ram_efficient_loading and self.world_size > 1
        if efficient:  # rank 0's values are sent shard by shard after sharding
            full = rank0_parameters(module) if self.is_global_zero else {}
        elif s.sync_module_states and self.world_size > 1 and not loaded_split:
            sync_module_states(module)  # every rank starts from rank 0's weights, whatever seed built them
        what = self._apply_tp(user, loaded_split)
        blocks = blocks_to_wrap(module, s.wrap, s.min_num_params)
        # torchtitan's order: TP, activation checkpointing (done before setup: setup_activation_checkpointing),
        # compile, fully_shard (no blocks: the root's forward; torch_compile.regions: blocks refuses that)
        if compiles_blocks(self.config):
            compiled = compile_blocks(module, self.config, blocks)
        else:
            compiled = compile_units(blocks or [module], self.config)
        if dims.fsdp:
            pin = self.accelerator.pin_memory if s.offload_pin_memory is None else s.offload_pin_memory
            apply_fsdp(
                module,
                blocks,
                dp_mesh(mesh, dims),
                reshard=s.reshard,
                offload=s.offload,
                pin_memory=pin,
                mp_policy=self._mp_policy,
                forward_prefetch=s.forward_prefetch,
            )
        if efficient:
            if on_meta:  # only this rank's shards are materialised
                module.to_empty(device="cpu" if s.offload else self.root_device)
            scatter_from_rank0(module, full, self.root_device)
            del full
        extras = [
            f"{len(blocks)} wrapped block(s)",
            *(["CPU offload"] if s.offload else []),
            *([f"{self._checkpointed} checkpointed block(s)"] if self._checkpointed else []),
            *([f"{compiled} compiled forward(s)"] if compiled else []),
        ]
        log.info(
            "%s: %s, %s over %d rank(s) (dp x cp), %s.",
            self.name,
            what,
            "FSDP" if dims.fsdp else "no FSDP",
            dims.dp_cp,
            ", ".join(extras),
        )
        self._root = module
        return module

    def _apply_tp(self, user: nn.Module, loaded_split: bool) -> str:
        """Tensor parallelism over `tp` (tp_plan.parallelize_tp); returns what was done, for the log line. A
        subclass that splits the model its own way at this point overrides it (expert_parallel.py)."""
        from kiln.strategies.mesh.tp_plan import parallelize_tp

        what, self._loss_parallel = parallelize_tp(
            user,
            self.device_mesh,
            self.settings,
            self.shape.tp,
            loaded_split=loaded_split,
            restyle=self.precision.tensor_parallel_style,
        )
        return what

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Every parallelism changes the module in place: the wrapped module is the user's module."""
        return getattr(model, "_orig_mod", model)

    def batch_to_device(self, batch: Any) -> Any:
        """Under cp, a training batch becomes this rank's chunk of its sequences (with shift_labels and
        position_ids made before the split: context_parallel.prepare_batch), split on the host before
        it moves. Evaluation batches (the module in eval mode) stay whole: evaluation is not context
        parallel, every cp rank computes the full sequences."""
        if self.shape.cp > 1 and self._root is not None and self._root.training:
            from kiln.strategies.mesh.context_parallel import prepare_batch

            batch = prepare_batch(batch, self.shape.cp, self._cp_rank, self.cp_load_balance, self.cp_packed)
        return super().batch_to_device(batch)

    @contextlib.contextmanager
    def eval_cast_context(self, module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
        """Around one evaluation. When units do not reshard after forward (shard_grad_op) a forward
        without a backward leaves every unit's parameters gathered, and nothing reshards them: the
        optimizer then updates the shards while later forwards keep reading the stale gathered copies
        (an evaluation after training reported the untrained loss). So every unit is resharded when
        the evaluation ends."""
        with super().eval_cast_context(module, dtype):
            try:
                yield
            finally:
                if not self.settings.reshard and self._root is not None:
                    from kiln.strategies.mesh.fsdp import reshard_all

                    reshard_all(self._root)  # the set-up module (a TrainingModule's StepDispatcher)

    # -- step -------------------------------------------------------------------------------
    def micro_batch_context(self, model: nn.Module, *, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        """FSDP's gradient sync on the window's last micro-batch; cp's attention dispatcher and loss
        parallel's context around forward and backward (micro_batch.py)."""
        return micro_batch_contexts(self, self.unwrap(model), boundary=boundary)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The true global 2-norm over FSDP shards and TP splits, then every shard scaled alike (clip.py)."""
        from kiln.strategies.mesh.clip import clip_global_norm

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_global_norm(params, max_norm, tp=self.shape.tp > 1, world=self.world_size, device=self.root_device)

    def probe_module(self, model: nn.Module) -> nn.Module:  # never called: capabilities.auto_batch_size is False
        raise NotImplementedError(f"auto_find_batch_size is not supported with strategy {self.name!r}.")

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.mesh.checkpoint_io import FullCheckpointIO, ShardedCheckpointIO

        cls = ShardedCheckpointIO if self.settings.state_dict_type == "sharded" else FullCheckpointIO
        return cls(self)

    def async_checkpoints(self) -> AsyncDCPSaver:
        """This process group's asynchronous DCP saves (save.async with state_dict_type sharded)."""
        if self._async_checkpoints is None:
            self._async_checkpoints = AsyncDCPSaver()
        return self._async_checkpoints

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights (FSDP shards and TP splits gathered, ties kept as one tensor) with the
        module's own key names, on CPU; rank 0 only (the others get {}) unless every node writes
        (save.on_each_node)."""
        from kiln.strategies.mesh.checkpoint_io import full_model_state

        every_rank = bool(self.config.save.on_each_node) if self.config is not None else False
        return full_model_state(self.unwrap(module), every_rank=every_rank)

    def teardown(self) -> None:
        if self._async_checkpoints is not None:
            self._async_checkpoints.close()
        self.device_mesh, self._dp_group, self._root, self._loss_parallel = None, None, None, None
        self._async_checkpoints = None
        super().teardown()
