"""The Strategy contract: where the model lives, how it is replicated or sharded, and how gradients,
optimizer steps, collectives and checkpoints work across processes and devices.

A new strategy is one file that subclasses `Strategy` (plus `SingleProcessCollectives` when it runs
one process, `ProcessGroupCollectives` from kiln/strategies/collectives.py when it runs one process per
device; a new way to shard is a preset of the mesh strategy, kiln/strategies/mesh/), declares its
`capabilities` and `options`, opts into the optional interfaces of
`kiln/strategies/interfaces.py` it needs by inheriting them, and registers its names
(`@STRATEGIES.register("name")` plus one `add_lazy` line where the registry is filled). `kiln/engine/`
never changes for it: the engine calls only these methods, in this order, for every strategy
(`[Interface]` marks a call made only when `isinstance(strategy, Interface)`):

    strategy = cls(config, precision)          # cheap: reads the topology, picks the device, no process group
    check_compatible(...)                      # capabilities vs precision/device/options, before anything starts
    strategy.setup_environment()               # process group, current device
    precision = strategy.connect_precision(precision)   # may substitute its own flavour (and log it)
    [ShardedModuleInit] with strategy.module_init_context():   # meta device / deepspeed.zero.Init
        model = model_init()                   # only when the Trainer builds the model
    setup = strategy.setup(module, optimizer_factory, scheduler_factory, max_steps=N)   # once, joint;
        # evaluation before training calls it without factories, and training calls it again with
        # them and the run's optimizer step count (None when not known yet: auto_find_batch_size)
    loader = strategy.process_dataloader(loader)   # capabilities.static_shapes: the Trainer drops short batches
    per micro-batch:  batch = strategy.batch_to_device(batch)
    per window:       [OwnsMicroBatchWindow] losses = strategy.run_window(model, window, weights)
                          # a pipeline schedule runs every forward and backward itself, in place of:
    per micro-batch:  [BackwardSyncControl] with strategy.micro_batch_context(model, boundary=...):
                          with precision.forward_context(): loss = forward ... x weight
                          strategy.backward(loss, model, boundary=...)
                      [GraphBoundaries] strategy.on_micro_batch_end()            # XLA's sync
    per step:         result = strategy.optimizer_step(model, optimizer, max_grad_norm)
                          # owns unscale -> reduce -> clip -> step -> skip-on-inf; StepResult(stepped, grad_norm)
                      strategy.zero_grad(model, optimizer); [GraphBoundaries] strategy.on_step_end()
    checkpoints:      strategy.checkpoint_io() -> CheckpointIO (save / load / load_weights_only; its `format`)
    export:           strategy.model_state_for_export(module)
    strategy.teardown()                        # by the Trainer when its work is done (see teardown)

What is not a strategy's business: torch.compile (the engine compiles the module `setup` returns, or
`setup_compile_regions` its blocks before `setup`; a strategy that cannot be compiled says so in
`Capabilities.torch_compile`) and optimizers that update
parameters inside backward (LOMO: the engine hands them the loss itself).

Collectives have no default: a strategy spanning processes that forgot one would silently let ranks
diverge, so a class that inherits neither `SingleProcessCollectives` nor `ProcessGroupCollectives`
and does not implement every name in `COLLECTIVES` is refused when it is created (TypeError).

Sizes: `data_shards` processes read distinct data (the sampler's replicas); `item_shards` processes
hold distinct items once `batch_to_device` has run (item and token counts are summed over them:
`data_shards`, unless a strategy splits each data shard's batch further, as context parallelism
splits the sequences over its cp ranks); `grad_divisor` is what the gradient reduction divides by (DDP averages over its world; SPMD runs one
process whose gradients are already global, so 1); `num_devices` counts the devices doing the work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
from kiln.utils.errors import ConfigError
from kiln.utils.kernels import per_parameter_kernels_where_mixed
from kiln.utils.tensors import move_to_device

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.accelerators.base import Accelerator
    from kiln.precision.base import Precision

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass
class StepResult:
    """What one optimizer step did. `grad_norm` (the total norm before clipping, or None when not
    clipped) stays a device tensor: the loop reads it only on logging steps."""

    stepped: bool
    grad_norm: torch.Tensor | None = None


@dataclass
class Setup:
    """What `Strategy.setup` hands back: the module to run forward on, and the optimizer and
    scheduler to train with (the strategy's own wrappers where it has them; None when set up for
    evaluation only)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None


#: the collectives every strategy must implement (or inherit from SingleProcessCollectives)
COLLECTIVES = ("reduce", "all_gather", "all_gather_object", "broadcast_object", "barrier")


class Strategy:
    """The required core every strategy implements; see the module docstring for the call order."""

    name: ClassVar[str] = "base"
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: strategy-specific options a config may set under `strategy:` beyond the common fields
    #: (name -> one line of help); anything else there is refused with a suggestion
    options: ClassVar[dict[str, str]] = {}
    #: the checkpoint formats `checkpoint_io()` may return (names in kiln.strategies.checkpoint_io.FORMATS),
    #: its default first: what the docs and `kiln convert` know this strategy writes
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("full",)
    #: `fit_failed` aborted this process's process group: no collective (nor a new fit) can run on it
    aborted: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, at class creation, a strategy whose collectives would silently be the identity."""
        super().__init_subclass__(**kwargs)
        missing = [name for name in COLLECTIVES if getattr(cls, name) is getattr(Strategy, name)]
        if missing:
            raise TypeError(
                f"strategy class {cls.__qualname__} does not implement the collective(s) {', '.join(missing)}. A strategy "
                "that spans processes must implement every one of them (an identity default would let the ranks diverge "
                "silently); a strategy that runs one process inherits kiln.strategies.base.SingleProcessCollectives "
                "(listed before Strategy among its bases)."
            )

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        self.config = config
        self.precision = precision
        self._wrapped: nn.Module | None = None
        self._source: nn.Module | None = None  # the module `_wrapped` was set up from
        self._check_options()

    def _check_options(self) -> None:
        import difflib

        given = dict(self.config.strategy.get("options") or {}) if self.config is not None else {}
        for key in given:
            if key not in self.options:
                close = difflib.get_close_matches(key, [*self.options, *_COMMON_FIELDS], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                known = ", ".join(sorted(self.options)) or "none beyond the common fields"
                raise ConfigError(
                    f"Unknown option strategy.{key} for strategy {self.name!r}.{hint} Its options: {known}."
                )

    def option(self, key: str, default: Any = None) -> Any:
        """A declared strategy-specific option (`strategy.<key>` in the config)."""
        value = (self.config.strategy.get("options") or {}).get(key) if self.config is not None else None
        return default if value is None else value

    # -- topology ---------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def accelerator(self) -> Accelerator:
        """The device kind's accelerator (RNG, memory counters, cache, pin-memory default)."""
        from kiln.accelerators import accelerator_for

        return accelerator_for(self.root_device)

    world_size: int = 1
    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def is_local_zero(self) -> bool:
        return self.local_rank == 0

    @property
    def data_shards(self) -> int:
        """Processes that read distinct batches (the train sampler's replicas)."""
        return self.world_size

    @property
    def data_shard_rank(self) -> int:
        return self.global_rank

    @property
    def item_shards(self) -> int:
        """Processes whose micro-batches hold distinct items after `batch_to_device`: what the loop sums
        item counts (the loss weights' global total) and token counts over. The data shards, unless the
        strategy splits each data shard's batch further (context parallel: dp x cp)."""
        return self.data_shards

    @property
    def grad_divisor(self) -> int:
        """What the gradient reduction divides by (1: gradients are summed, or there is none)."""
        return self.world_size

    @property
    def num_devices(self) -> int:
        """Devices doing the work (for throughput per device)."""
        return self.world_size

    # -- set-up -----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Initialise the process group / device. Safe to call more than once."""

    def connect_precision(self, precision: Precision) -> Precision:
        """Return the precision plugin this strategy will really use (FSDP/DeepSpeed may substitute
        their own flavour; they must log that they did)."""
        self.precision = precision
        return precision

    def setup(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory | None = None,
        scheduler_factory: SchedulerFactory | None = None,
        *,
        max_steps: int | None = None,
    ) -> Setup:
        """Set up module, optimizer and scheduler together. Without factories (evaluation before
        training) only the module is set up; a later call with factories reuses it. `max_steps` is
        the run's optimizer step count (what `scheduler_factory` builds the schedule for; None when
        unknown yet): a strategy whose own config needs it (DeepSpeed's "auto" scheduler steps) reads it here.

        A different `module` than the last call's (a second `train()` with `model_init`) is set up
        from scratch. Default order: precision casts the module, the strategy wraps it (`setup_module`),
        the optimizer is built over the wrapped parameters (FSDP has sharded them by then), and
        `setup_optimizer` lets the precision plugin connect both."""
        if self._wrapped is None or self._source is not module:  # a new module (a new run) is set up anew
            self._source = module
            module = self.precision.convert_module(module)
            self._wrapped = self.setup_module(module)
        if optimizer_factory is None:
            return Setup(self._wrapped)
        optimizer = optimizer_factory(self._wrapped)
        per_parameter_kernels_where_mixed(optimizer)  # a user's optimizer over tp-split and plain parameters
        model, optimizer = self.setup_optimizer(self._wrapped, optimizer)
        self._wrapped = model
        scheduler = scheduler_factory(optimizer) if scheduler_factory is not None else None
        return Setup(model, optimizer, scheduler)

    def setup_activation_checkpointing(self, module: nn.Module) -> list[nn.Module]:
        """Checkpoint the repeated blocks of `module` as the config's `activation_checkpointing` says, before
        `setup` (kiln.strategies.activation_checkpointing); returns the checkpointed blocks. A strategy that
        wraps blocks of its own (FSDP units) checkpoints the same blocks."""
        from kiln.strategies.activation_checkpointing import checkpoint_model, find_blocks, policy

        chosen = policy(self.config)
        return checkpoint_model(module, chosen, find_blocks(module) if chosen else [])

    def setup_compile_regions(self, module: nn.Module) -> int:
        """`torch_compile: {regions: blocks}`: compile each repeated block of `module` on its own, in place,
        before `setup` and after `setup_activation_checkpointing` (the compiled forward wraps the checkpointed
        one), so the strategy's wrapper runs its hooks around compiled blocks and the engine leaves the set-up
        module uncompiled (kiln.strategies.regional_compile). The blocks are those activation checkpointing
        and FSDP's wrap find. Returns how many were compiled. A strategy that compiles its own blocks later
        (FSDP2: after the tp split) overrides it."""
        from kiln.config.compile import compiles_blocks
        from kiln.strategies.activation_checkpointing import find_blocks
        from kiln.strategies.regional_compile import compile_blocks

        return compile_blocks(module, self.config, find_blocks(module) if compiles_blocks(self.config) else [])

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move to the device and wrap (DDP, FSDP...). Returns the module to run forward on."""
        return module.to(self.root_device)

    def setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Hook for wrapping model and optimizer together; by default the precision plugin gets to
        connect them (apex's amp.initialize)."""
        return self.precision.connect(model, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module inside whatever wrapper `setup_module` (and the engine's torch.compile) added."""
        return getattr(model, "_orig_mod", model)

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        """Hook for device-feeding loaders (XLA's MpDeviceLoader)."""
        return dataloader

    def batch_to_device(self, batch: Any) -> Any:
        """Move to the device, then let the precision plugin cast inputs (true half precision)."""
        return self.precision.convert_input(move_to_device(batch, self.root_device))

    # -- step -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module, *, boundary: bool = True) -> None:
        """Backward of an already-normalised loss (kiln weights each micro-batch itself: a strategy
        must not divide by the accumulation steps again)."""
        self.precision.backward(loss)

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        """The whole step: unscale, (reduce), clip to `max_grad_norm` (None or 0: no clipping), step
        unless the gradients hold inf/nan. Returns whether it stepped and the pre-clip norm."""
        grad_norm = None
        if max_grad_norm:
            self.precision.unscale_gradients(optimizer)
            grad_norm = self.clip_gradients(model, optimizer, max_grad_norm)
        stepped = self.precision.optimizer_step(optimizer)
        return StepResult(stepped, grad_norm)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip all (unscaled) gradients to `max_norm`; returns the total norm before clipping."""
        groups = optimizer.param_groups  # clip_grad_norm_ leaves out parameters without a gradient itself
        params = groups[0]["params"] if len(groups) == 1 else [p for group in groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    # -- evaluation and probing -------------------------------------------------------------
    def probe_module(self, model: nn.Module) -> nn.Module:
        """The module `auto_find_batch_size` runs its out-of-memory probe on: without gradient
        synchronisation, so a rank that runs out of memory cannot leave another in a collective."""
        return self.unwrap(model)

    def eval_cast_context(self, module: nn.Module, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
        """HF's fp16_full_eval / bf16_full_eval: the module cast to `dtype` for one evaluation and
        put back bit for bit afterwards (only where `capabilities.full_eval_cast`)."""
        from kiln.utils.cast import cast_module_temporarily

        return cast_module_temporarily(module, dtype)

    # -- collectives: called on every rank; no default (see SingleProcessCollectives) ---------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """`tensor` reduced over every rank with `op` (sum, mean, max, min). Where several ranks hold
        copies of the same values (the tensor-parallel ranks of one data shard) sum and mean count them
        once: they span the `item_shards` ranks whose values differ; max and min still span every rank."""
        raise NotImplementedError

    def reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        """Start `reduce` and return a function that waits for it and gives the result, so the
        communication overlaps with the caller's work (e.g. a forward pass). This fallback reduces
        at once (correct, without the overlap)."""
        done = self.reduce(tensor, op)
        return lambda: done

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack `tensor` from every rank along a new first dimension (one entry per data shard, its
        first rank's, where several ranks share one: see `reduce`)."""
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order (one per data shard, as `all_gather`)."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank."""
        raise NotImplementedError

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank."""
        raise NotImplementedError

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        """The object that writes/reads this strategy's model and optimizer files."""
        return FullStateCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights of the user's `module` (called on every rank; written by rank 0),
        with the module's own key names."""
        return module.state_dict()

    def fit_failed(self, error: BaseException, fit_call: int) -> dict[str, Any] | None:
        """`fit()` raised `error` on this rank (this process's `fit_call`-th fit, counted from 0): agree with
        the other ranks and, unless every rank's fit failed too, abort the process group so that they stop
        now rather than wait in a collective until its timeout (kiln/strategies/abort.py). Returns the
        record ({"rank", "error"}) of a rank that aborted before this one failed, if any; after an abort this
        process has no process group (`aborted`). One process: nothing to stop."""
        return None

    def teardown(self) -> None:
        """Release the process group and device state. `Trainer.teardown()` calls it (the user does, or
        `with Trainer(...)` on leaving the block), since only the user knows when no later evaluate or
        predict will reuse the strategy; a strategy that owns a process group also registers it with
        `atexit`, the fallback for a Trainer nobody tore down. Must be idempotent."""


class SingleProcessCollectives:
    """The collectives of a strategy that runs one process: every one is the identity. Inherit it
    before `Strategy` (`class MyStrategy(SingleProcessCollectives, Strategy)`)."""

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: str | None = None) -> None:
        return None


#: fields every strategy config has (kiln.config.schema.strategy.StrategyConfig), offered in suggestions
_COMMON_FIELDS = (
    "name",
    "device",
    "backend",
    "timeout",
    "find_unused_parameters",
    "bucket_cap_mb",
    "broadcast_buffers",
    "static_graph",
)
