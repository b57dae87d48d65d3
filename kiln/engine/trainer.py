"""The Trainer facade: builds the strategy, precision plugin and callbacks from the config, and
exposes Hugging Face's override points (`get_train_dataloader`, `create_optimizer`,
`create_scheduler`, `compute_loss`, `training_step`, `prediction_step`, `log`, ...), which the loops
call so that subclassing works as HF users expect."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kiln.config.hf.args import is_training_arguments
from kiln.engine.arguments import config_or_args, pop_objects
from kiln.engine.backend import build_backend
from kiln.engine.callbacks.base import Callback, CallbackHandler
from kiln.engine.callbacks.defaults import default_callbacks
from kiln.engine.callbacks.early_stopping import resolve_greater_is_better
from kiln.engine.checkpoint.best_model import load_best_model
from kiln.engine.checkpoint.output_dir import refuse_overwrite, run_lock
from kiln.engine.checkpoint.resume import choose_resume
from kiln.engine.data.trainer_loaders import TrainerLoaders
from kiln.engine.distributed import check_same_output_dir
from kiln.engine.evaluation.metric_files import log_metrics, metrics_format, save_metrics
from kiln.engine.hp_search import HyperparameterSearch, check_searchable
from kiln.engine.hp_trial import TrialRecipe, building_trial
from kiln.engine.loop.evaluate import EvaluateLoop, PredictLoop
from kiln.engine.loop.evaluation import EvaluationLoop
from kiln.engine.loop.fit import FitLoop, TrainOutput
from kiln.engine.loop.fit_errors import fit_errors, stopping_peers
from kiln.engine.loop.fit_evaluation import check_eval_setup
from kiln.engine.loop.loss_weights import MicroBatch
from kiln.engine.loop.prediction_step import prediction_step
from kiln.engine.model.loss import model_loss
from kiln.engine.model.model_init import build_model, trainer_model
from kiln.engine.model.neftune import neftune
from kiln.engine.model.summary import print_start_summary
from kiln.engine.run import setup_for_eval
from kiln.engine.run_start import start_run
from kiln.engine.seed import set_seed
from kiln.engine.trainer_attributes import RunAttributes
from kiln.launch.settings import load_with_launcher_settings
from kiln.optim.optimizers import build_optimizer
from kiln.optim.schedulers import build_scheduler, scheduler_needs_metrics
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.evaluation.outputs import EvalLoopOutput, PredictionOutput
    from kiln.engine.hp_search import BestRun
    from kiln.engine.model.module import TrainingModule


class Trainer(RunAttributes):
    """Train, evaluate and predict with a TrainingModule or an HF-contract nn.Module.

    `config` is a TrainingConfig, dict (HF flat names allowed), YAML path, DictConfig or a
    `transformers.TrainingArguments`; HF's keyword `args=` is accepted for it. `strategy` and
    `precision` may also be passed as objects (a Strategy/Precision class or instance).

    Every per-fit object (model, optimizer, scheduler, set-up module, live batch sizes, state,
    control, checkpoint manager) lives in `self.run` (kiln.engine.run.Run); the HF attributes
    `model`, `model_wrapped`, `optimizer`, `lr_scheduler`, `state` and `control` read and write it. Call `teardown()` (or use the Trainer as a context manager)
    when done with it: it releases the process group and restores global flags; otherwise that
    happens when the interpreter exits."""

    _init_call: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Trainer:
        trainer = super().__new__(cls)
        # the constructor's arguments: each hyperparameter-search trial builds its own Trainer from them,
        # through this class's constructor (hp_trial.build_trial_trainer)
        trainer._init_call = (args, kwargs)
        return trainer

    def __init__(
        self,
        model: nn.Module | None = None,
        config: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        compute_metrics: Callable[..., dict[str, float]] | None = None,
        callbacks: Iterable[Callback | type] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
        model_init: Callable[..., nn.Module] | None = None,
        strategy: Any = None,
        precision: Any = None,
        processing_class: Any = None,
        overrides: Iterable[str] = (),
        args: Any = None,
    ) -> None:
        search = building_trial()  # this Trainer trains one hyperparameter-search trial (hp_trial.py)
        config = config_or_args(config, args)
        # saved as training_args.bin (HF); a trial's is built from the trial's config
        self._given_args = config if is_training_arguments(config) and search is None else None
        config, strategy, precision, overrides = pop_objects(config, strategy, precision, overrides)
        # accelerate launch fills unset keys; a trial's config is the searching Trainer's with the trial's values
        cfg = search.config if search is not None else load_with_launcher_settings(config, overrides)
        from kiln.loggers.metrics import MemoryTracker

        self.memory_tracker = MemoryTracker.from_config(cfg)  # HF's *_mem_* metrics; a no-op by default
        self.memory_tracker.start("init")
        # The strategy comes first: it decides where (and how sharded) a model the Trainer builds lives. The
        # config is read-only from here on (a model split at load may settle its strategy in a new one).
        cfg, self.strategy, self.precision = build_backend(
            cfg, model, strategy, precision, user_optimizer=optimizers[0] is not None
        )
        self.config = cfg
        self.loaders = TrainerLoaders(cfg, self.strategy)  # behind get_train/eval/test_dataloader
        set_seed(cfg.seed, cfg.full_determinism)
        self.model_init = model_init
        model = trainer_model(self.strategy, cfg, model, model_init, search.trial if search is not None else None)
        self.args = cfg  # HF code reads trainer.args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator, self.processing_class = data_collator, processing_class
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.is_in_train = False
        self._runs_started = 0
        self._remove_columns = bool(cfg.data.remove_unused_columns)  # read per micro-batch: a plain copy
        # num_items_in_batch is only worth waiting for (it is summed over ranks) when something reads
        # it; otherwise the all-reduce runs while the first forward does
        self.wants_num_items = (
            type(self).compute_loss is not Trainer.compute_loss or type(self).training_step is not Trainer.training_step
        )
        self.callback_handler = CallbackHandler(
            default_callbacks(cfg, self.strategy),
            model=model,
            processing_class=processing_class,
            optimizer=optimizers[0],
            lr_scheduler=optimizers[1],
        )
        for cb in callbacks or ():
            self.callback_handler.add(cb)
        # behind hyperparameter_search: each trial's Trainer is built as this one was (callbacks added later too)
        recipe = TrialRecipe(type(self), self._init_call, cfg, self.callback_handler.callbacks)
        self.hp_search = HyperparameterSearch(recipe)
        self.run = start_run(
            cfg,
            self.strategy,
            self.precision,
            self.callback_handler,
            model,
            optimizers=optimizers,
            trial=search,
            training_args=self._given_args,
        )
        self.control = self.callback_handler.call("on_init_end", cfg, self.state, self.control)
        self.memory_tracker.stop("init")

    def _start_run(self, model: nn.Module | None = None) -> None:
        """A new Run (run_start.py) of this Trainer's trial, if any: for `model`, or continuing the current
        one's model when None."""
        self.run = start_run(
            self.config,
            self.strategy,
            self.precision,
            self.callback_handler,
            model,
            previous=self.run,
            trial=self.run.trial,
            training_args=self._given_args,
        )
        self.callback_handler.objects["model"] = self.run.model

    @property
    def model(self) -> nn.Module:
        return self.run.model

    @model.setter
    def model(self, model: nn.Module) -> None:
        """A new run for `model`: set up anew by the strategy, without the previous one's optimizer; the state and
        control stay (HF keeps them when the model is replaced)."""
        old = self.run
        self._start_run(model)
        self.run.state, self.run.control = old.state, old.control

    # -- callbacks (HF API) -----------------------------------------------------------------
    def add_callback(self, callback: Callback | type) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback: Callback | type) -> Callback | None:
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback: Callback | type) -> None:
        self.callback_handler.pop(callback)

    # -- ranks ------------------------------------------------------------------------------
    def is_world_process_zero(self) -> bool:
        return self.strategy.is_global_zero

    def is_local_process_zero(self) -> bool:
        return self.strategy.is_local_zero

    # -- optimizer & scheduler (HF override points) -----------------------------------------
    def create_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            # facts.training_module is is_training_module(self.model): the cast only tells mypy what it found
            configured = (
                cast("TrainingModule", self.model).configure_optimizers() if self.run.facts.training_module else None
            )
            if isinstance(configured, (tuple, list)):
                self.optimizer, self.lr_scheduler = configured[0], configured[1] if len(configured) > 1 else None
            elif configured is not None:
                self.optimizer = configured
            else:
                self.optimizer = build_optimizer(self.model, self.config.optim)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.lr_scheduler is None:
            optimizer = optimizer or self.optimizer
            assert optimizer is not None  # HF's order: create_optimizer() has run (create_optimizer_and_scheduler)
            self.lr_scheduler = build_scheduler(optimizer, self.config.scheduler, num_training_steps)
            self.run.created_scheduler = True  # a new run builds it again for its own length (HF)
        self.run.scheduler_needs_metrics = scheduler_needs_metrics(self.lr_scheduler)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps, self.optimizer)

    def compute_loss(
        self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The loss of one micro-batch (mean over its items); override for a custom loss."""
        return model_loss(
            self.run.facts, self.model, model, inputs, return_outputs, num_items_in_batch, self.forward_inputs
        )

    def forward_inputs(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        names = self.run.facts.forward_names
        if not self._remove_columns or names is None or inputs.keys() <= names:  # nothing to drop: no new dict
            return inputs
        return {k: v for k, v in inputs.items() if k in names}

    def training_step(
        self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None, micro_batch: MicroBatch | None = None
    ) -> torch.Tensor:
        """Forward, loss, backward for one micro-batch; returns its detached (weighted) loss.

        The micro-batch's place in its accumulation window (its loss weight, whether it ends the window)
        is `micro_batch`, by default the one the step has in flight (`Run.micro_batch`), so an override
        with HF's signature calling `super().training_step(model, inputs, num_items_in_batch)` weighs
        exactly too."""
        micro_batch = micro_batch if micro_batch is not None else self.run.micro_batch
        with self.precision.forward_context():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        weight = (
            micro_batch.weight if micro_batch is not None and micro_batch.weights is not None else None
        )  # read once
        loss = loss * weight if weight is not None else loss
        if self.run.backward_owner is not None:  # LOMO: the optimizer updates the weights inside backward
            self.run.backward_owner.backward_and_step(loss)
        else:
            self.strategy.backward(loss, model, boundary=micro_batch.boundary if micro_batch is not None else True)
        return loss.detach()

    # -- data (HF override points; data/trainer_loaders.py) -------------------------------------
    def get_train_dataloader(self) -> Iterable[Any]:
        """kiln's sampler (seeded by (data_seed, epoch), sharded over ranks, resumable in O(1)) over the
        model's inputs. A DataLoader passed as train_dataset is used as given."""
        return self.loaders.train(self.run, self.train_dataset, self.data_collator, self.processing_class)

    def fit(
        self, resume_from_checkpoint: Any = None, trial: Any = None, ignore_keys_for_eval: list[str] | None = None
    ) -> TrainOutput:
        with stopping_peers(self.strategy):  # an error here aborts the process group: the other ranks stop too
            check_same_output_dir(self.config, self.strategy)  # one collective: a mismatch fails here, not in a save
            with run_lock(self.config, self.strategy):  # one run per output_dir at a time (checkpoint/output_dir.py)
                return self._fit(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _fit(self, resume_from_checkpoint: Any, trial: Any, ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        cfg = self.config
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else cfg.resume_from_checkpoint
        path = choose_resume(resume, cfg, self.strategy)
        if path is None and not self._runs_started:  # a second train() continues this Trainer's own files
            refuse_overwrite(cfg)
        if trial is not None and trial is not self._trial:
            raise KilnError(
                "fit(trial=...) is driven by hyperparameter_search. To train with found hyperparameters, "
                "build Trainer(model_init=..., config={**config, **best_run.hyperparameters})."
            )
        check_eval_setup(cfg, self.eval_dataset, type(self).get_eval_dataloader is not Trainer.get_eval_dataloader)
        from kiln.engine.data.checks import check_training_data

        check_training_data(
            self.train_dataset, self.data_collator, self.model, self.run.facts.training_module
        )  # before model work
        print_start_summary(self.model, self.strategy, self.precision, cfg)
        if self._runs_started:  # HF: every train() is a new run, not a resume of the last
            self._start_new_run()
        search = self.run.trial
        if search is not None:
            self.state.is_hyper_param_search, self.state.trial_name = True, search.name
            self.state.trial_params = dict(search.params)
        self._runs_started += 1
        self.is_in_train = True
        self.memory_tracker.start("train")
        try:
            with fit_errors(cfg, self.run), neftune(self.model, cfg.train.neftune_noise_alpha):
                loop = FitLoop(
                    self,
                    self.run,
                    self.strategy,
                    self.precision,
                    self.callback_handler,
                    self.checkpoints,
                    cfg,
                    self.memory_tracker,
                    wants_num_items=self.wants_num_items or self.run.facts.accepts_num_items,
                    ignore_keys_for_eval=ignore_keys_for_eval,
                )
                return loop.run_fit(path)
        finally:
            self.is_in_train = False
            self.precision.teardown()  # its global flags, restored once the fit is no longer in train

    train = fit  # HF name

    def _start_new_run(self) -> None:
        """A second `fit()` starts a new run, as in HF. With `model_init`, the seed (possibly changed in
        the config since) is set again and a fresh model is built, with a fresh optimizer and schedule
        (HF drops a given pair too); without it, training continues from the current weights with the
        same optimizer. Either way the state starts over (step 0, empty log history, no best metric),
        and a schedule the Trainer built itself is built again for the new run's length."""
        model = None
        if self.model_init is not None:
            set_seed(
                self.config.seed, self.config.full_determinism
            )  # before the model is built, so its init follows the seed
            model = build_model(self.strategy, self.model_init, self._trial)
        self._start_run(model)

    # -- hyperparameter search (HF API; hp_search.py) ----------------------------------------------
    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float | list[float]] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun | list[BestRun]:
        """Search hyperparameters with Optuna (HF's signature); kwargs go to `optuna.create_study`.
        Returns the best run, or the Pareto-best runs for several directions. `backend="ray"`: with
        Ray Tune, kwargs as HF's (`resources_per_trial`, `scheduler`, ...)."""
        check_searchable(backend, self.model_init, self.run.user_optimizer, self.strategy.world_size)
        return self.hp_search.run(hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs)

    def _report_to_trial(self, metrics: dict[str, float]) -> None:
        """After each evaluation during a search trial: its objective so far; a trial Optuna prunes ends here."""
        trial = self.run.trial
        if trial is not None and trial.report(metrics, self.state.global_step):
            self.control = self.callback_handler.call("on_train_end", self.config, self.state, self.control)
            import optuna

            raise optuna.TrialPruned()

    def teardown(self) -> None:
        """Release what this Trainer holds outside Python objects: the strategy's process group and
        device state, and the precision plugin's global flags. Call it when done with the Trainer
        (`with Trainer(...) as trainer:` does); `kiln fit/evaluate/predict` call it at the end. A
        Trainer that is never torn down is torn down when the interpreter exits (an atexit fallback)."""
        self.precision.teardown()
        self.strategy.teardown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    # -- evaluation and prediction (HF API and override points; the loops are in kiln/engine/loop/) ------
    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """Metrics `<prefix>_loss`, `compute_metrics`' keys prefixed, speed and `epoch`; logged and
        passed to `on_evaluate`. A dict of datasets is evaluated one by one as `<prefix>_<name>_*`.
        `gen_kwargs` go to `model.generate` with `predict_with_generate`."""
        loop = EvaluateLoop(self, self.run, self.strategy, self.callback_handler, self.config, self.memory_tracker)
        return loop.run_evaluate(eval_dataset, ignore_keys, metric_key_prefix, gen_kwargs)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        """Numpy predictions and label_ids in dataset order (ragged sequences right-padded with
        `eval.padding_index`) and metrics (`<prefix>_loss` etc. when the data has labels)."""
        loop = PredictLoop(self, self.run, self.strategy, self.callback_handler, self.config, self.memory_tracker)
        return loop.run_predict(test_dataset, ignore_keys, metric_key_prefix, gen_kwargs)

    def evaluation_loop(
        self,
        dataloader: Iterable[Any],
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """Shared by evaluate ("Evaluation": TrainingModule.validation_step) and predict
        ("Prediction": predict_step). Works with or without labels."""
        s, cb = self.strategy, self.callback_handler
        loop = EvaluationLoop(self, self.run, s, self.precision, cb, self.config, in_train=self.is_in_train)
        return loop.run_pass(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) for one batch, each possibly None (HF override point)."""
        return prediction_step(
            self, self.run, self.precision, self.config, model, inputs, prediction_loss_only, ignore_keys
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Iterable[Any]:
        """The eval DataLoader: in order, sharded contiguously over ranks; `eval_dataset` may be a dataset, or the
        name of one in a dict passed to the Trainer; reused with `dataloader_persistent_workers` (eval_loaders.py)."""
        return self.loaders.eval(self.run, self.eval_dataset, eval_dataset, self.data_collator)

    def get_test_dataloader(self, test_dataset: Any) -> Iterable[Any]:
        return self.loaders.test(self.run, test_dataset, self.data_collator)

    def setup_model(self) -> nn.Module:
        """The module set up by the strategy for evaluation (before training: without an optimizer)."""
        return setup_for_eval(self.run, self.strategy, self.config)

    def greater_is_better(self) -> bool:
        return resolve_greater_is_better(self.config.eval)

    def _load_best_model(self) -> None:
        load_best_model(self.state, self._load_from_checkpoint)

    def _load_from_checkpoint(self, path: str) -> None:
        """The model weights of `path` (a checkpoint or a save_model folder), without optimizer state (HF's name)."""
        from kiln.engine.checkpoint.weights import load_weights_for_eval

        load_weights_for_eval(self.strategy, self.setup_model(), self.model, path)

    def metrics_format(self, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Human-readable values (runtimes as h:mm:ss.xx, memory in MB, floats to 4 places)."""
        return metrics_format(metrics)

    def log_metrics(self, split: str, metrics: Mapping[str, float]) -> None:
        """Print `***** <split> metrics *****` and aligned `key = value` lines, on global rank 0."""
        log_metrics(self.strategy, split, metrics)

    def save_metrics(self, split: str, metrics: Mapping[str, float], combined: bool = True) -> None:
        """Write raw `<split>_results.json` (and merge it into `all_results.json`), on global rank 0."""
        save_metrics(self.strategy, self.config.output_dir, split, metrics, combined)

    # -- logging & saving -------------------------------------------------------------------
    def current_learning_rate(self) -> float:
        run = self.run
        scheduler = run.scheduler
        if scheduler is not None and hasattr(scheduler, "get_last_lr") and not run.scheduler_needs_metrics:
            return float(scheduler.get_last_lr()[0])
        return float(run.optimizer.param_groups[0]["lr"]) if run.optimizer is not None else 0.0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record `logs` in the state's history and send them to every logger (on_log)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        # figures the fit loop hands to the loggers but keeps out of log_history (throughput)
        extra, self.log_to_loggers_only = self.log_to_loggers_only, None
        logs = {**logs, **extra} if extra else logs
        self.control = self.callback_handler.call("on_log", self.config, self.state, self.control, logs=logs)

    def _save_checkpoint(self, metrics: dict[str, float] | None = None) -> str:
        """Write `checkpoint-<global_step>` (HF's override point; `metrics` is accepted for HF's signature:
        the best metric is already in the state)."""
        return self.checkpoints.save(self.state)

    def save_model(self, output_dir: str | None = None, max_shard_size: int | str | None = None) -> str:
        """Export full weights (safetensors) plus config; loadable without kiln, and with
        `from_pretrained` for Transformers models. Above `max_shard_size` (bytes or "5GB", as
        `save_pretrained`) the weights are split into shards with a `model.safetensors.index.json`."""
        from kiln.engine.checkpoint.export import export_model

        folder = export_model(
            self.model,
            self.strategy,
            self.config,
            self.processing_class,
            output_dir or self.config.output_dir,
            max_shard_size,
            self._given_args,
        )
        if output_dir is None:  # the run's own folder: its store gets the model too (checkpoint/remote_run.py)
            self.checkpoints.upload_outputs()
        return folder

    def save_state(self) -> None:
        """Write trainer_state.json into output_dir (global rank 0). Every rank calls it, as HF's: with a
        store, the upload's verdict reaches every rank (checkpoint/remote_run.py)."""
        if self.strategy.is_global_zero:
            os.makedirs(self.config.output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(self.config.output_dir, "trainer_state.json"))
        self.checkpoints.upload_outputs()
