"""A `Run`: every per-fit object, from the model it starts with to what a checkpoint hands back for
the loop to apply.

The Trainer (the HF-compatible facade) holds one Run at a time, and its HF attributes (`state`,
`control`, `model`, `optimizer`, `lr_scheduler`, ...) are properties over it. `start_run` (run_start.py) is
the one constructor: the Trainer's first run, a second `fit()` (HF: every train() is a new run) and a model
assigned to `trainer.model` all go through it. The loops and the checkpoint code receive the Run
rather than the Trainer. Its parts:

- the model as the user gave it (`model`), the module the strategy sets up (`forward_module`: a
  TrainingModule behind its StepDispatcher, so wrappers that hook `forward` see every step) and the
  set-up module the loops run forward on (`wrapped`);
- the optimizer and scheduler (`optimizer`, `scheduler`) and how far set-up has gone (`stage`:
  None, "eval" with the module only, "train" with the optimizer too);
- the live micro-batch size and accumulation (`micro_batch_size`, `accumulation`): the config's
  values until `auto_find_batch_size` or an out-of-memory recovery changes them, which never
  writes back into the config (a checkpoint's config.yaml records the live values);
- an optimizer that updates the weights inside backward (`backward_owner`, LOMO);
- what the engine derives from the model (`facts`: labels, item counting, call convention);
- HF's `TrainerState` and `TrainerControl` (`state`, `control`). The Run is the control's one owner:
  every callback event's return value is written to `control` (a callback may return a new object,
  as HF allows), and every reader reads it there;
- the checkpoint manager of this run (`checkpoints`), the throughput figures the next `log()` sends
  to the loggers only (`log_to_loggers_only`), and the hyperparameter-search trial it trains (`trial`);
- the evaluation call in flight (`eval_step`, `gen_kwargs`), which `prediction_step` reads;
- the evaluation loaders it reuses (`eval_loaders`, HF's `_eval_dataloaders` with persistent workers) and the
  evaluation module compiled for `eval.compile` (`eval_compiler`): built over this run's model, collator and
  data, so a new run (a second `fit()`, a model assigned to `trainer.model`) builds its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.engine.compile import compile_module, compile_optimizer_step
from kiln.engine.evaluation.compiled import EvalCompiler
from kiln.engine.model.facts import ModelFacts
from kiln.optim.local_step import step_dtensors_locally
from kiln.optim.merged_step import step_equal_groups_as_one
from kiln.optim.schedulers import scheduler_needs_metrics
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from kiln.engine.model.module import TrainingModule


@dataclass(eq=False)
class Run:
    model: nn.Module
    facts: ModelFacts
    micro_batch_size: int
    accumulation: int
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    #: the optimizer came from the user (`optimizers=(opt, sched)`), not from kiln or the TrainingModule
    user_optimizer: bool = False
    #: the scheduler was built by kiln for this run's length (a new run builds it again, as HF does)
    created_scheduler: bool = False
    scheduler_needs_metrics: bool = False
    forward_module: nn.Module | None = None
    wrapped: nn.Module | None = None
    stage: str | None = None
    backward_owner: Any = None
    #: the micro-batch `training_step` is running, for an override with HF's signature (see loop/step.py)
    micro_batch: Any = None
    #: set-up modules -> their torch.compile wrappers (one compilation per set-up module)
    _compiled: dict[int, nn.Module] = field(default_factory=dict)
    state: TrainerState = field(default_factory=TrainerState)
    control: TrainerControl = field(default_factory=TrainerControl)
    #: the run's CheckpointManager (kiln.engine.checkpoint.manager, which reads the Run: typed Any to keep
    #: the import one-way; `start_run` builds it)
    checkpoints: Any = None
    #: throughput figures the next `log()` sends to the loggers only (kept out of log_history)
    log_to_loggers_only: dict[str, float] | None = None
    #: the hyperparameter-search trial this run trains (None outside a search)
    trial: Any = None
    #: the evaluation call in flight, for a `prediction_step` override with HF's signature (loop/prediction_step.py):
    #: the step a TrainingModule runs ("validation_step" or "predict_step") and `model.generate`'s kwargs
    eval_step: str = "validation_step"
    gen_kwargs: dict[str, Any] = field(default_factory=dict)
    #: name ("eval" for a dataset passed in) -> the reused eval loader (dataloader_persistent_workers; eval_loaders.py)
    eval_loaders: dict[str, Any] = field(default_factory=dict)
    #: the evaluation module through torch.compile (eval.compile, HF's jit_mode_eval)
    eval_compiler: EvalCompiler = field(default_factory=EvalCompiler)

    def __post_init__(self) -> None:
        if self.wrapped is None:
            self.wrapped = self.model

    @property
    def window_samples(self) -> int:
        """Samples per optimizer step on one data shard (micro-batch size x accumulation)."""
        return self.micro_batch_size * self.accumulation


def module_to_set_up(run: Run, config: Any, strategy: Any) -> nn.Module:
    """The module the strategy sets up: a TrainingModule behind its StepDispatcher. When the config asks, the
    chunked loss goes inside the model's forward first (so the strategy's wrapper still calls it), and the
    repeated blocks are checkpointed (the strategy's `setup_activation_checkpointing`: one path for every
    strategy, before it casts, splits, compiles or shards the module), then compiled one by one where
    `torch_compile.regions` asks (`setup_compile_regions`)."""
    if run.forward_module is None:
        from kiln.engine.model.step_dispatcher import StepDispatcher

        if config.train.loss.chunked:
            from kiln.engine.model.chunked_loss import use_chunked_loss

            use_chunked_loss(run.model, config.train.loss.chunk_size)
        # facts.training_module is is_training_module(run.model), so the cast only tells mypy what it found
        module = StepDispatcher(cast("TrainingModule", run.model)) if run.facts.training_module else run.model
        strategy.setup_activation_checkpointing(module)
        strategy.setup_compile_regions(
            module
        )  # torch_compile.regions: blocks, after checkpointing (torchtitan's order)
        run.forward_module = module
    return run.forward_module


def setup_for_eval(run: Run, strategy: Any, config: Any) -> nn.Module:
    """The module set up by the strategy for evaluation (before training: without an optimizer)."""
    if run.stage is None:
        run.wrapped = compiled(run, strategy.setup(module_to_set_up(run, config, strategy)).model, config, strategy)
        run.stage = "eval"
    assert run.wrapped is not None
    return run.wrapped


def setup_for_training(
    run: Run,
    strategy: Any,
    precision: Any,
    config: Any,
    create_optimizer: Callable[[], torch.optim.Optimizer],
    create_scheduler: Callable[[int, torch.optim.Optimizer], Any],
    max_steps: int | None,
) -> None:
    """Module, optimizer and (given the step count) scheduler, set up by the strategy in one call.
    `create_optimizer` / `create_scheduler` are the Trainer's HF override points."""
    if run.stage != "train":
        schedule = (lambda optimizer: create_scheduler(max_steps, optimizer)) if max_steps is not None else None
        setup = strategy.setup(
            module_to_set_up(run, config, strategy), lambda _model: create_optimizer(), schedule, max_steps=max_steps
        )
        run.wrapped, run.optimizer = compiled(run, setup.model, config, strategy), setup.optimizer
        compile_optimizer_step(run.optimizer, strategy, config.train)
        if not strategy.capabilities.owns_optimizer_step:  # HF's two groups, stepped as one while their settings agree
            step_equal_groups_as_one(run.optimizer)
            step_dtensors_locally(run.optimizer)  # Adam's DTensor parameters stepped through their local shards
        if setup.scheduler is not None:
            run.scheduler = setup.scheduler
        run.backward_owner = backward_owner(run.optimizer, strategy, precision)
        run.stage = "train"
    elif max_steps is not None and run.scheduler is None:  # set up earlier without a step count (auto batch size)
        assert run.optimizer is not None
        create_scheduler(max_steps, run.optimizer)
    run.scheduler_needs_metrics = scheduler_needs_metrics(run.scheduler)
    if max_steps is not None:
        precision.setup()


def compiled(run: Run, model: nn.Module, config: Any, strategy: Any = None) -> nn.Module:
    """`model` through torch.compile when the config asks (`train.torch_compile*`), once per set-up
    module: a second set-up of the same module (evaluation first, then training) reuses the wrapper,
    and with it dynamo's cache, so training does not compile again what evaluation compiled. A model
    concern, not a strategy's (the strategy has wrapped and sharded the module by now), except for a
    strategy that compiles per block itself (`Capabilities.compiles_per_block`, FSDP2); one that cannot be compiled
    refuses the setting before the run starts. See kiln/engine/compile.py."""
    key = id(model)
    if key not in run._compiled:
        run._compiled = {key: compile_module(model, strategy, config)}
    return run._compiled[key]


def backward_owner(optimizer: Any, strategy: Any, precision: Any) -> Any:
    """`optimizer` if it updates the parameters inside backward (`owns_backward = True` and
    `backward_and_step(loss)`, e.g. LOMO), else None: the step then hands it the loss instead of
    calling the strategy's backward, and its optimizer step has nothing left to do."""
    if not getattr(optimizer, "owns_backward", False):
        return None
    name = type(optimizer).__name__
    if strategy.world_size > 1:
        raise ConfigError(
            f"{name} updates each parameter inside backward, before gradients could be averaged "
            "across processes, so the ranks would drift apart; run it on one process."
        )
    if precision.uses_grad_scaler:
        raise ConfigError(
            f"{name} updates each parameter inside backward, before a gradient scaler could unscale "
            "or skip the step; use precision bf16 or fp32 (LOMO scales an fp16 loss itself)."
        )
    return optimizer
