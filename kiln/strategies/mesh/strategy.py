"""The one sharding strategy: every process on one named DeviceMesh (dims.py: dp_replicate, dp_shard,
cp, tp; pp and ep in their own subclasses, pipeline.py and expert_parallel.py), each parallelism
applied to the model by its own `apply_*` function, in torchtitan's order:

    tensor parallel      apply_tp (tp_plan.py; sequence_parallel.py, loss_parallel.py)  over `tp`
                         -- or the TrainingModule's own `configure_model(mesh)`
    activation ckpt      apply_activation_checkpointing (../activation_checkpointing.py) on the wrapped blocks
    compile              compile_units (../regional_compile.py)                         each block's forward
    FSDP2                apply_fsdp (fsdp.py)                                           over dp (x cp)
    context parallel     context_parallel.py, at the batch and micro-batch seams       over `cp`

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
See `reduce` for what sums and means count; `all_gather` / `all_gather_object` keep one entry per data
shard (its first rank's); max / min, `broadcast_object` and `barrier` span every rank. The process
group and the plain collectives are ProcessGroupCollectives' (one process per device)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.strategies.base import Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.collectives import ProcessGroupCollectives, check_op
from kiln.strategies.interfaces import BackwardSyncControl, ShardedModuleInit
from kiln.strategies.mesh.async_dcp import AsyncDCPSaver
from kiln.strategies.mesh.dims import (
    ParallelDims,
    build_device_mesh,
    dp_mesh,
    flatten_axes,
    parse_mesh,
    release_mesh_groups,
)
from kiln.strategies.mesh.settings import MeshSettings
from kiln.strategies.process_group import register_group_user
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)


class MeshStrategy(ProcessGroupCollectives, Strategy, BackwardSyncControl, ShardedModuleInit):
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

    # -- checks, before any process group starts ------------------------------------------------
    def _check_settings(self) -> None:
        """What the settings cannot do on this mesh, refused in one sentence each, the same sentence
        under both presets."""
        s, dims = self.settings, self.shape
        if s.offload and s.offload_pin_memory and self.root_device.type == "cpu":
            raise ConfigError(
                "FSDP offload with pinned memory needs an accelerator, but this run is on the CPU; "
                "set strategy.offload_pin_memory: false (or run on a GPU)."
            )
        if s.offload and not dims.fsdp:
            raise ConfigError(
                f"strategy.offload moves FSDP's shards to the CPU, and this mesh ({dims.describe()}) is "
                "tensor parallel alone, with no FSDP to offload; give the mesh a data-parallel axis "
                "(dp_shard) or drop offload."
            )
        for key in ("sequence_parallel", "loss_parallel"):
            if getattr(s, key) and dims.tp == 1:
                raise ConfigError(
                    f"strategy.{key} splits the activations of tensor parallelism, and this mesh has no "
                    f"tp axis ({dims.describe()}); set mesh.tp (fsdp: strategy.tp) to 2 or more, or drop "
                    f"{key}."
                )
        if s.cpu_ram_efficient_loading and dims.tp > 1:
            raise ConfigError(
                "strategy.cpu_ram_efficient_loading builds the model on rank 0 alone, which tensor "
                f"parallelism cannot split from (this mesh: {dims.describe()}); drop it, or the tp axis."
            )
        if self.precision.name == "fp8" and dims.cp * dims.pp * dims.ep > 1:
            raise ConfigError(
                f"precision fp8 runs on the data and tp axes only, and this mesh ({dims.describe()}) splits the "
                "model over context, pipeline or expert axes too (float8 with those is not wired in yet); keep the "
                "mesh to dp_shard / dp_replicate / tp, or use precision: bf16."
            )
        if self.config is not None and self.config.train.loss.chunked and dims.tp > 1:
            raise ConfigError(
                "train.loss.chunked multiplies the hidden states by the whole LM head chunk by chunk, and tensor "
                f"parallelism splits that head over this mesh's tp axis ({dims.describe()}); drop train.loss.chunked "
                "(strategy.loss_parallel keeps the logits split over tp instead) or the tp axis."
            )
        self._check_cp_config()

    def _check_cp_config(self) -> None:
        """What cp has not been made to work with, refused before any process group starts."""
        if self.shape.cp == 1 or self.config is None:
            return
        _ = self.cp_load_balance  # a wrong value fails here, not at the first batch
        train = self.config.train
        if train.label_smoothing_factor:
            raise ConfigError(
                "label_smoothing_factor with strategy.mesh.cp > 1 is not supported: kiln's label smoother "
                "shifts each rank's chunk of labels itself and would drop every chunk boundary's target."
            )
        if train.neftune_noise_alpha:
            raise ConfigError(
                "neftune_noise_alpha with strategy.mesh.cp > 1 is not supported: NEFTune scales its noise "
                "by the sequence length, which each cp rank sees as its chunk's."
            )

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
            check_model(module, self.root_device.type)
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
        """Tensor parallelism over `tp`: transformers' split kept as it is, the TrainingModule's own
        `configure_model(mesh)`, or the plan (`tp_plan`); returns what was done, for the log line."""
        from kiln.strategies.mesh.tp_plan import apply_tp

        s, dims = self.settings, self.shape
        hook = getattr(user, "configure_model", None)
        if loaded_split:
            return f"the tensor parallelism transformers applied at load (tp {dims.tp})"
        if callable(hook):
            given = [
                key
                for key, on in (
                    ("tp_plan", s.tp_plan is not None),
                    ("sequence_parallel", s.sequence_parallel),
                    ("loss_parallel", s.loss_parallel),
                )
                if on
            ]
            if given:
                raise ConfigError(
                    f"{type(user).__name__} defines configure_model(mesh), which parallelises the model "
                    f"itself, and strategy.{' and strategy.'.join(given)} {'is' if len(given) == 1 else 'are'}"
                    " set too; drop one of them (configure_model can apply torch's SequenceParallel and "
                    "loss_parallel itself)."
                )
            hook(self.device_mesh)  # the user's own parallelize code (TP, and FSDP on blocks if it wants)
            return "configure_model(mesh)"
        if dims.tp == 1:
            return "no tensor parallelism"
        tp = apply_tp(
            user,
            self.device_mesh["tp"],
            s.tp_plan,
            dims.tp,
            sequence_parallel=s.sequence_parallel,
            loss_parallel=s.loss_parallel,
            restyle=self.precision.tensor_parallel_style,
        )
        self._loss_parallel = tp.loss_parallel
        return (
            f"{tp.layers} tensor-parallel layer(s)"
            + (", sequence parallel" if tp.sequence_parallel else "")
            + (", loss parallel" if tp.loss_parallel is not None else "")
        )

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

            batch = prepare_batch(batch, self.shape.cp, self._cp_rank, self.cp_load_balance)
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
        """FSDP reduce-scatters once per accumulation window, on its last micro-batch. Under cp the
        micro-batch's forward and backward run inside torch's ring-attention dispatcher; with loss
        parallel inside torch's `loss_parallel()`; with both (cp x tp), inside both."""
        from kiln.strategies.mesh.fsdp import is_fsdp

        root = self.unwrap(model)
        if is_fsdp(root):
            root.set_requires_gradient_sync(boundary)
        contexts: list[contextlib.AbstractContextManager[Any]] = []
        if self.shape.cp > 1:
            from kiln.strategies.mesh.context_parallel import ring_attention

            contexts.append(ring_attention(self.device_mesh["cp"], self.cp_load_balance))
        if self._loss_parallel is not None:
            contexts.append(self._loss_parallel.context())
        return _all_of(contexts)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The true global 2-norm over FSDP shards and TP splits, then every shard scaled alike (clip.py)."""
        from kiln.strategies.mesh.clip import clip_global_norm

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_global_norm(params, max_norm, tp=self.shape.tp > 1, world=self.world_size, device=self.root_device)

    def probe_module(self, model: nn.Module) -> nn.Module:  # never called: capabilities.auto_batch_size is False
        raise NotImplementedError(f"auto_find_batch_size is not supported with strategy {self.name!r}.")

    # -- collectives: each distinct value counted once ---------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """sum and mean span the ranks whose values differ: the data shards and, within one, the cp
        ranks (each holds its own chunk of the sequences, so item and token counts, FLOPs and the
        loss weighted by them add up over dp x cp: each token once); the tp ranks of one position
        hold copies and count once (the reduction runs over the ranks at this rank's tp position,
        `dp x cp` of them). A value that is the same on the cp ranks of one data shard (per sample:
        a sample count, anything from evaluation, which is not context parallel) must be reduced with
        mean, max or min -- a sum would count it cp times. kiln's training loop sums only values
        counted on the rank's own chunk. max / min span every rank."""
        if op in ("max", "min") or self.shape.tp == 1:  # without tp every rank holds distinct data
            return super().reduce(tensor, op)
        return self._reduce_over_data(tensor, op)

    def _reduce_over_data(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """sum or mean over `_dp_group`, the ranks whose data differ (`dp x cp` of them; None: this rank alone)."""
        import torch.distributed as dist

        check_op(op)
        t = self._comm(torch.as_tensor(tensor))
        if op == "mean" and not t.is_floating_point():
            t = t.double()
        if self._dp_group is not None:
            dist.all_reduce(t, group=self._dp_group)
        if op == "mean":
            t = t / self.shape.dp_cp
        return t.to(torch.as_tensor(tensor).device)

    def reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        if op != "sum" or self.shape.tp == 1:
            return super().reduce_async(tensor, op)
        return self._sum_over_data_async(tensor)

    def _sum_over_data_async(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`_reduce_over_data`'s sum, started now; the returned call waits for it."""
        import torch.distributed as dist

        t, device = self._comm(torch.as_tensor(tensor)), torch.as_tensor(tensor).device
        work = dist.all_reduce(t, group=self._dp_group, async_op=True) if self._dp_group is not None else None

        def wait() -> torch.Tensor:
            if work is not None:
                work.wait()
            return t.to(device)

        return wait

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return super().all_gather(tensor)[:: self.shape.model_ranks]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return super().all_gather_object(obj)[:: self.shape.model_ranks]

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.mesh.checkpoint_io import FullCheckpointIO, ShardedCheckpointIO

        cls = ShardedCheckpointIO if self.settings.state_dict_type == "sharded" else FullCheckpointIO
        return cls(self)

    def async_checkpoints(self) -> AsyncDCPSaver:
        """This process group's asynchronous DCP saves (save.async with state_dict_type sharded)."""
        if self._async_checkpoints is None:
            self._async_checkpoints = AsyncDCPSaver(pin_memory=self.root_device.type == "cuda")
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


@contextlib.contextmanager
def _all_of(contexts: list[contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
