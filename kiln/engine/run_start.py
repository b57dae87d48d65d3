"""`start_run`: the one constructor of a `Run` (kiln/engine/run.py), with the checkpoint manager that
reads it. The Trainer's first run, every later `fit()` (HF: every train() is a new run) and a model
assigned to `trainer.model` are built here, so no code copies a Run's fields by hand."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.engine.checkpoint.manager import CheckpointManager
from kiln.engine.evaluation.compiled import EvalCompiler
from kiln.engine.model.facts import ModelFacts
from kiln.engine.run import Run

if TYPE_CHECKING:
    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy


def start_run(
    config: Any,
    strategy: Strategy,
    precision: Precision,
    callbacks: CallbackHandler,
    model: nn.Module | None = None,
    *,
    previous: Run | None = None,
    optimizers: tuple[Any, Any] = (None, None),
    trial: Any = None,
    training_args: Any = None,
) -> Run:
    """The one constructor of a Run: a fresh state, control and checkpoint manager, and either `model`
    as given (not yet set up; `optimizers` is the user's pair, if any) or, without `model`, `previous`'s
    model continued: its set-up module, optimizer and facts, and its scheduler unless kiln built that
    one for the previous run's length (HF builds it again). The live batch sizes are the config's; the
    evaluation loaders and compiled evaluation module are built anew (the data may have changed since)."""
    if model is None:
        assert previous is not None
        run = replace(
            previous,
            micro_batch_size=int(config.data.per_device_train_batch_size),
            accumulation=int(config.train.gradient_accumulation_steps),
            micro_batch=None,
            scheduler=None if previous.created_scheduler else previous.scheduler,
            created_scheduler=False,
            eval_loaders={},  # built over the previous run's data and collator
            eval_compiler=EvalCompiler(),
        )
    else:
        run = Run(
            model,
            ModelFacts.of(model, config),
            int(config.data.per_device_train_batch_size),
            int(config.train.gradient_accumulation_steps),
            optimizer=optimizers[0],
            scheduler=optimizers[1],
            user_optimizer=optimizers[0] is not None,
        )
    run.state = TrainerState(
        is_world_process_zero=strategy.is_global_zero, is_local_process_zero=strategy.is_local_zero
    )
    run.control, run.log_to_loggers_only, run.trial = TrainerControl(), None, trial
    run.checkpoints = CheckpointManager(config, strategy, precision, callbacks, run, training_args)
    return run
