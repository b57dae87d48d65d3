"""The Trainer facade: builds the strategy, precision plugin and callbacks from the config, and
exposes Hugging Face's override points (`get_train_dataloader`, `create_optimizer`,
`create_scheduler`, `compute_loss`, `training_step`, `prediction_step`, `log`, ...), which the loops
call so that subclassing works as HF users expect."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from kiln.engine.loop.batch_size import is_out_of_memory
from kiln.engine.callbacks.base import Callback, CallbackHandler, DefaultFlowCallback
from kiln.engine.checkpoint.manager import CheckpointManager
from kiln.engine.checkpoint.output_dir import refuse_overwrite, run_lock
from kiln.engine.checkpoint.resume import choose_resume
from kiln.engine.data.loaders import build_dataloader
from kiln.engine.distributed import check_same_output_dir, configure_logging
from kiln.utils.errors import KilnError
from kiln.engine.loop.fit import FitLoop, TrainOutput
from kiln.engine.hp_search import HyperparameterSearchMixin, call_model_init
from kiln.engine.loop.loss_weights import MicroBatch
from kiln.engine.model.label_smoothing import label_smoothing_factor
from kiln.engine.model.neftune import neftune
from kiln.engine.model.module import (
    default_label_names, forward_argument_names, is_training_module, item_counter, loss_from_output, model_accepts_loss_kwargs,
)
from kiln.optim.optimizers import build_optimizer
from kiln.optim.schedulers import build_scheduler, scheduler_needs_metrics
from kiln.engine.seed import set_seed
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.engine.trainer_eval import EvaluationMixin
from kiln.engine.trainer_setup import SetupMixin, _config_or_args, _pop_objects
from kiln.precision import build_precision
from kiln.strategies import build_strategy, check_run_compatible
from kiln.launch.settings import load_with_launcher_settings


class Trainer(SetupMixin, EvaluationMixin, HyperparameterSearchMixin):
    """Train, evaluate and predict with a TrainingModule or an HF-contract nn.Module.

    `config` is a TrainingConfig, dict (HF flat names allowed), YAML path, DictConfig or a
    `transformers.TrainingArguments`; HF's keyword `args=` is accepted for it. `strategy` and
    `precision` may also be passed as objects (a Strategy/Precision class or instance)."""

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        config: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        data_collator: Optional[Callable[[list[Any]], Any]] = None,
        compute_metrics: Optional[Callable[..., dict[str, float]]] = None,
        callbacks: Optional[Iterable[Union[Callback, type]]] = None,
        optimizers: tuple[Optional[torch.optim.Optimizer], Any] = (None, None),
        preprocess_logits_for_metrics: Optional[Callable[[Any, Any], Any]] = None,
        model_init: Optional[Callable[..., nn.Module]] = None,
        strategy: Any = None,
        precision: Any = None,
        processing_class: Any = None,
        overrides: Iterable[str] = (),
        args: Any = None,
    ) -> None:
        config = _config_or_args(config, args)
        config, strategy, precision, overrides = _pop_objects(config, strategy, precision, overrides)
        self.config = load_with_launcher_settings(config, overrides)  # accelerate launch fills unset keys
        cfg = self.config
        from kiln.loggers.metrics import MemoryTracker

        self.memory_tracker = MemoryTracker.from_config(cfg)  # HF's *_mem_* metrics; a no-op by default
        self.memory_tracker.start("init")
        # The strategy comes first: it decides where (and how sharded) a model the Trainer builds lives.
        self.precision = precision if precision is not None and not isinstance(precision, type) else build_precision(cfg, precision)
        self.strategy = build_strategy(cfg, self.precision, strategy)
        check_run_compatible(self.strategy, self.precision, cfg, user_optimizer=optimizers[0] is not None)
        self.strategy.setup_environment()
        configure_logging(cfg, self.strategy)  # log.level on the main process, log.level_replica elsewhere
        self.precision = self.strategy.connect_precision(self.precision)
        self.precision.check_device(self.strategy.root_device)
        set_seed(cfg.seed, cfg.full_determinism)
        if model is None:
            if model_init is None:
                raise KilnError("Trainer needs a model: pass `model=` or `model_init=` (a callable returning the model).")
            with self.strategy.module_init_context():
                model = call_model_init(model_init)  # model_init(None) when it takes the trial (HF)
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module (a TrainingModule or an HF-contract model), not {type(model).__name__}.")
        self.model_init = model_init
        self.model = model
        if cfg.train.use_cache is not None and getattr(model, "config", None) is not None:
            model.config.use_cache = cfg.train.use_cache  # HF sets it from TrainingArguments.use_cache
        # what a hyperparameter-search trial needs to build a sibling Trainer
        self._init_kwargs = dict(train_dataset=train_dataset, eval_dataset=eval_dataset, data_collator=data_collator,
                                 compute_metrics=compute_metrics, callbacks=list(callbacks or ()),
                                 preprocess_logits_for_metrics=preprocess_logits_for_metrics, strategy=strategy,
                                 precision=precision, processing_class=processing_class)
        self._trial: Any = None  # the Optuna trial this Trainer trains (hyperparameter_search)
        self._objective: Any = None
        self.args = cfg  # HF code reads trainer.args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator, self.processing_class = data_collator, processing_class
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self._user_optimizer = optimizers[0] is not None
        self.state = TrainerState(is_world_process_zero=self.strategy.is_global_zero, is_local_process_zero=self.strategy.is_local_zero)
        self.control = TrainerControl()
        self.checkpoints = CheckpointManager(self)
        self.is_in_train = False
        self._adopt_model(model)
        # plain copies of settings read per micro-batch (OmegaConf lookups cost microseconds)
        self._remove_columns = bool(cfg.data.remove_unused_columns)
        self._global_mean = bool(cfg.train.average_tokens_across_devices)
        #: the micro-batch `training_step` is running (set by the fit loop; also passed as `micro_batch=`)
        self.current_micro_batch: Optional[MicroBatch] = None
        # num_items_in_batch is only worth waiting for (it is summed over ranks) when something reads
        # it; otherwise the all-reduce runs while the first forward does
        self.wants_num_items = self._accepts_num_items or type(self).compute_loss is not Trainer.compute_loss or \
            type(self).training_step is not Trainer.training_step
        self.scheduler_needs_metrics = False
        self.log_to_loggers_only: Optional[dict[str, float]] = None  # throughput the next log() sends to loggers only
        self.model_wrapped: nn.Module = model
        self._setup_stage: Optional[str] = None  # None, "eval" (module only) or "train" (module + optimizer)
        self._forward_module: Optional[nn.Module] = None
        self.callback_handler = CallbackHandler(self._default_callbacks(), model=model, processing_class=processing_class)
        for cb in callbacks or ():
            self.callback_handler.add(cb)
        self.control = self.callback_handler.call("on_init_end", cfg, self.state, self.control)
        self.memory_tracker.stop("init")

    #: kiln's own constructor, reachable from subclasses that define another `__init__` (a
    #: hyperparameter-search trial builds its Trainer with it)
    kiln_init = __init__
    def _adopt_model(self, model: nn.Module) -> None:
        """What the Trainer derives from its model (also for the fresh model of a new run)."""
        cfg = self.config
        self._training_module = is_training_module(model)
        self.label_names = list(cfg.data.label_names) if cfg.data.label_names else (
            ["labels"] if self._training_module else default_label_names(model))
        self._forward_names = None if self._training_module else forward_argument_names(model)
        self._accepts_num_items = not self._training_module and model_accepts_loss_kwargs(model)  # HF's rule
        self._count_items = model.num_items if self._training_module else item_counter(model, self.label_names)
        self._label_smoothing = label_smoothing_factor(model, cfg.train.label_smoothing_factor)  # 0 for multi-label (HF)

    def _default_callbacks(self) -> list[Callback]:
        from kiln.engine.callbacks.progress import console_callbacks

        cbs: list[Callback] = [DefaultFlowCallback(), *console_callbacks(self.config)]
        cbs += self._debug_callbacks()
        if self.strategy.is_global_zero:  # exactly one tracker run per job, by construction
            from kiln.engine.callbacks.loggers import LoggerCallback
            from kiln.loggers.build import build_loggers

            cbs.append(LoggerCallback(self.config, build_loggers(self.config)))
        return cbs

    def _debug_callbacks(self) -> list[Callback]:
        """`debug: underflow_overflow` / `tpu_metrics_debug` and `torch_empty_cache_steps` (HF's TrainingArguments)."""
        cbs: list[Callback] = []
        if "underflow_overflow" in self.config.train.debug:
            from kiln.engine.callbacks.debug_overflow import DebugUnderflowOverflow

            cbs.append(DebugUnderflowOverflow())
        if "tpu_metrics_debug" in self.config.train.debug:  # validated: only with a device that keeps a report
            from kiln.engine.callbacks.device_metrics import DeviceMetricsReport

            cbs.append(DeviceMetricsReport(self.strategy.accelerator.metrics_report, self.strategy.is_global_zero))
        if self.config.train.torch_empty_cache_steps:
            from kiln.engine.callbacks.empty_cache import EmptyCacheCallback, device_empty_cache

            cbs.append(EmptyCacheCallback(self.config.train.torch_empty_cache_steps,
                                          device_empty_cache(self.strategy.root_device)))
        return cbs

    # -- callbacks (HF API) -----------------------------------------------------------------
    def add_callback(self, callback: Union[Callback, type]) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback: Union[Callback, type]) -> Optional[Callback]:
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback: Union[Callback, type]) -> None:
        self.callback_handler.pop(callback)

    # -- ranks ------------------------------------------------------------------------------
    def is_world_process_zero(self) -> bool:
        return self.strategy.is_global_zero

    def is_local_process_zero(self) -> bool:
        return self.strategy.is_local_zero

    # -- data -------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Iterable[Any]:
        if self.train_dataset is None:
            raise KilnError("Trainer.fit() needs a train_dataset (or override get_train_dataloader).")
        if isinstance(self.train_dataset, torch.utils.data.DataLoader):
            return self.strategy.process_dataloader(self.train_dataset)  # used as given
        cfg, strategy = self.config, self.strategy
        seed = cfg.data_seed if cfg.data_seed is not None else cfg.seed
        drop_last = bool(cfg.data.dataloader_drop_last or strategy.static_shapes)  # see kiln.engine.data.static_shapes
        loader = build_dataloader(
            self.train_dataset, cfg.data.per_device_train_batch_size, self.data_collator, cfg.data, seed, shuffle=True,
            num_replicas=strategy.data_shards, rank=strategy.data_shard_rank, sampler=self._length_grouped_sampler(seed),
            drop_last=drop_last, pin_memory=strategy.accelerator.pin_memory, broadcast=strategy.broadcast_object,
        )
        if drop_last and not cfg.data.dataloader_drop_last:
            from kiln.engine.data.static_shapes import report_drop_last

            report_drop_last(self.train_dataset, loader, strategy.data_shards, strategy.name)
        return strategy.process_dataloader(loader)

    def _length_grouped_sampler(self, seed: int) -> Any:
        if not self.config.data.group_by_length:
            return None
        from kiln.engine.data.length_grouping import LengthGroupedSampler

        return LengthGroupedSampler.for_dataset(self.train_dataset, self.config, seed, self.strategy)

    # -- optimizer & scheduler (HF override points) -----------------------------------------
    def create_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            configured = self.model.configure_optimizers() if self._training_module else None
            if isinstance(configured, (tuple, list)):
                self.optimizer, self.lr_scheduler = configured[0], configured[1] if len(configured) > 1 else None
            elif configured is not None:
                self.optimizer = configured
            else:
                self.optimizer = build_optimizer(self.model, self.config.optim)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, self.config.scheduler, num_training_steps)
            self._created_lr_scheduler = True  # a new run builds it again for its own length (HF)
        self.scheduler_needs_metrics = scheduler_needs_metrics(self.lr_scheduler)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps, self.optimizer)

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """The loss of one micro-batch (mean over its items); override for a custom loss."""
        if self._training_module:
            outputs = model(inputs)
        else:
            if not isinstance(inputs, Mapping):
                from kiln.engine.data.checks import describe

                raise KilnError(f"HF-contract models are called as model(**batch), so the batch must be a dict of tensors, "
                                f"not a {describe(inputs)}: return dicts from the dataset or the data_collator.")
            inputs = self.forward_inputs(inputs)
            kwargs = {"num_items_in_batch": num_items_in_batch} if num_items_in_batch is not None and self._model_divides([inputs]) else {}
            if self._label_smoothing and "labels" in inputs:
                from kiln.engine.model.label_smoothing import smoothed_loss

                labels = inputs["labels"]
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, **kwargs)
                loss = smoothed_loss(self.model, outputs, labels, self._label_smoothing, kwargs.get("num_items_in_batch"))
                return (loss, outputs) if return_outputs else loss
            outputs = model(**inputs, **kwargs)
        loss = loss_from_output(outputs)
        return (loss, outputs) if return_outputs else loss

    def forward_inputs(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        names = self._forward_names
        if not self._remove_columns or names is None or inputs.keys() <= names:  # nothing to drop: no new dict
            return inputs
        return {k: v for k, v in inputs.items() if k in names}

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None,
                      micro_batch: Optional[MicroBatch] = None) -> torch.Tensor:
        """Forward, loss, backward for one micro-batch; returns its detached (weighted) loss.

        `micro_batch` (its loss weight, whether it ends the accumulation window) defaults to the loop's
        `current_micro_batch`: HF-style `super().training_step(model, inputs, num_items_in_batch)` weighs exactly."""
        micro_batch = micro_batch if micro_batch is not None else self.current_micro_batch
        if self.precision.plain_forward:  # fp32 and true-half plugins: no context to enter every step
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        else:
            with self.precision.forward_context():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        weight = micro_batch.weight if micro_batch is not None and micro_batch.weights is not None else None  # read once
        loss = loss * weight if weight is not None else loss
        self.strategy.backward(loss, model, boundary=micro_batch.boundary if micro_batch is not None else True)
        return loss.detach()

    def fit(self, resume_from_checkpoint: Any = None, trial: Any = None, ignore_keys_for_eval: Optional[list[str]] = None) -> TrainOutput:
        check_same_output_dir(self.config, self.strategy)  # one collective: a mismatch fails here, not inside a save
        with run_lock(self.config, self.strategy):  # one run per output_dir at a time (checkpoint/output_dir.py)
            return self._fit(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _fit(self, resume_from_checkpoint: Any, trial: Any, ignore_keys_for_eval: Optional[list[str]]) -> TrainOutput:
        cfg = self.config
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else cfg.resume_from_checkpoint
        path = choose_resume(resume, cfg, self.strategy)
        if path is None and not getattr(self, "_runs_started", 0):  # a second train() continues this Trainer's own files
            refuse_overwrite(cfg)
        if trial is not None and trial is not self._trial:
            raise KilnError("fit(trial=...) is driven by hyperparameter_search. To train with found hyperparameters, "
                            "build Trainer(model_init=..., config={**config, **best_run.hyperparameters}).")
        self._ignore_keys_for_eval = ignore_keys_for_eval
        self._check_eval_setup()
        from kiln.engine.data.checks import check_training_data

        check_training_data(self.train_dataset, self.data_collator, self.model, self._training_module)  # before model work
        if self.strategy.is_global_zero and cfg.log.level not in ("error", "critical"):  # quiet runs stay quiet
            from kiln.engine.model.summary import model_summary

            print(f"kiln: {model_summary(self.model, self.strategy, self.precision)}", flush=True)
        if getattr(self, "_runs_started", 0):  # HF: every train() is a new run, not a resume of the last
            from kiln.engine.loop.new_run import start_new_run

            start_new_run(self, trial)
        self._runs_started = getattr(self, "_runs_started", 0) + 1
        self.is_in_train = True
        self.memory_tracker.start("train")
        try:
            with neftune(self.model, cfg.train.neftune_noise_alpha):
                return FitLoop(self).run(path)
        except KeyboardInterrupt:
            from kiln.engine.checkpoint.files import latest_checkpoint
            from kiln.utils.errors import TrainingInterrupted

            last = latest_checkpoint(cfg.output_dir) if os.path.isdir(cfg.output_dir) else None
            raise TrainingInterrupted(f"interrupted at step {self.state.global_step}; last checkpoint: {last or 'none'}") from None
        except Exception as err:
            if cfg.data.auto_find_batch_size and is_out_of_memory(err):
                raise KilnError(
                    f"Out of memory during training with per_device_train_batch_size={cfg.data.per_device_train_batch_size}, "
                    "which auto_find_batch_size found to fit the first step (a later batch can be longer): resume from "
                    "the last checkpoint or restart with a smaller per_device_train_batch_size."
                ) from err
            raise
        finally:
            self.is_in_train = False
            self.precision.teardown()
            from kiln.loggers.writer import flush_after_fit

            flush_after_fit(sys.exc_info()[1])  # an exception or the preemption exit skips on_train_end

    train = fit  # HF name

    # -- logging & saving -------------------------------------------------------------------
    def current_learning_rate(self) -> float:
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "get_last_lr") and not self.scheduler_needs_metrics:
            return float(self.lr_scheduler.get_last_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """Record `logs` in the state's history and send them to every logger (on_log)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        # figures the fit loop hands to the loggers but keeps out of log_history (throughput)
        extra, self.log_to_loggers_only = self.log_to_loggers_only, None
        logs = {**logs, **extra} if extra else logs
        self.control = self.callback_handler.call("on_log", self.config, self.state, self.control, logs=logs)

    def _save_checkpoint(self, metrics: Optional[dict[str, float]] = None) -> str:
        return self.checkpoints.save(metrics)

    def save_model(self, output_dir: Optional[str] = None, max_shard_size: Optional[Union[int, str]] = None) -> str:
        """Export full weights (safetensors) plus config; loadable without kiln, and with
        `from_pretrained` for Transformers models. Above `max_shard_size` (bytes or "5GB", as
        `save_pretrained`) the weights are split into shards with a `model.safetensors.index.json`."""
        from kiln.engine.checkpoint.export import export_model

        return export_model(self, output_dir or self.config.output_dir, max_shard_size)

    def save_state(self) -> None:
        if self.strategy.is_global_zero:
            os.makedirs(self.config.output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(self.config.output_dir, "trainer_state.json"))

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each optimizer param group (HF); an error before the optimizer exists."""
        return [group["lr"] for group in self._require_optimizer().param_groups]

    def get_optimizer_group(self, param: Union[str, nn.Parameter, None] = None) -> Any:
        """HF's API: the param group holding `param` (a Parameter or its name), else every group's params."""
        groups = self._require_optimizer().param_groups
        if isinstance(param, str):
            param = dict(self.model.named_parameters()).get(param)
        if param is not None:
            for group in groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in groups]

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before "
                             "(call create_optimizer() or train() first).")
        return self.optimizer
