"""The evaluation half of the Trainer: `evaluate`, `predict`, `evaluation_loop`, `prediction_step`
(HF's override points), evaluation during training, best-model tracking and HF's metric files.

One eval step, as data flows (the tensor logic lives in `kiln.engine.evaluation.gather`):

    batch -> strategy.batch_to_device -> precision.convert_input -> prediction_step -> (loss, logits, labels)
          -> preprocess_logits_for_metrics(logits, labels) -> EvalAccumulator.add({losses, predictions,
             label_ids[, inputs]})  (gathered across ranks, moved to CPU numpy every eval_accumulation_steps)
    end:  arrays in dataset order -> compute_metrics(EvalPrediction) -> metrics prefixed `<prefix>_`

With `batch_eval_metrics`, `compute_metrics(EvalPrediction, compute_result=is_last_batch)` is called
on every batch instead and predictions are not kept (except by `predict`, as in HF).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kiln.engine.callbacks.early_stopping import resolve_greater_is_better
from kiln.engine.checkpoint.best_model import metric_key, update_best
from kiln.engine.data.checks import check_eval_dataset
from kiln.engine.data.loaders import SequentialDistributedSampler
from kiln.engine.evaluation.batches import collected, inputs_for_metrics, sampler_of, with_last, write_metrics
from kiln.engine.evaluation.gather import EvalAccumulator, OrderedGatherer, gather_across_processes, nested_detach
from kiln.engine.evaluation.object_gather import ObjectAccumulator
from kiln.engine.evaluation.outputs import (
    EvalLoopOutput,
    EvalPrediction,
    PredictionOutput,
    eval_prediction,
    step_outputs,
    to_python,
)
from kiln.engine.run import setup_for_eval
from kiln.optim.optimizers import optimizer_mode
from kiln.precision.base import cast_floating
from kiln.utils.errors import KilnError
from kiln.utils.tensors import batch_size_of

if TYPE_CHECKING:
    from torch import nn

    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.engine.callbacks.state import TrainerControl, TrainerState
    from kiln.engine.evaluation.compiled import EvalCompiler
    from kiln.engine.run import Run
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy

logger = logging.getLogger(__name__)


class EvaluationMixin:
    """HF's evaluation API of the Trainer (the class these methods live on is `kiln.engine.trainer.Trainer`).
    The attributes below are the Trainer's that evaluation uses."""

    config: Any
    strategy: Strategy
    precision: Precision
    run: Run
    state: TrainerState
    control: TrainerControl
    callback_handler: CallbackHandler
    memory_tracker: Any
    model: nn.Module
    optimizer: Any
    lr_scheduler: Any
    eval_dataset: Any
    data_collator: Any
    compute_metrics: Any
    preprocess_logits_for_metrics: Any
    is_in_train: bool
    _eval_compiler: EvalCompiler
    _eval_dataloaders: dict[str, Any]
    _gen_kwargs: dict[str, Any]
    _eval_step_name: str
    _ignore_keys_for_eval: list[str] | None

    if TYPE_CHECKING:  # the Trainer's (and hyperparameter search's) methods that evaluation calls

        @property
        def label_names(self) -> list[str]: ...

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...
        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any: ...
        def forward_inputs(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]: ...
        def _model_inputs(self, dataset: Any, description: str) -> tuple[Any, Any]: ...
        def _report_to_trial(self, metrics: dict[str, float]) -> None: ...

    def setup_model(self) -> nn.Module:
        """The module set up by the strategy for evaluation (before training: without an optimizer)."""
        return setup_for_eval(self.run, self.strategy, self.config)

    # -- dataloaders (HF override points) ---------------------------------------------------
    def get_eval_dataloader(self, eval_dataset: Any = None) -> Iterable[Any]:
        """The eval DataLoader: in order, sharded contiguously over ranks (see SequentialDistributedSampler).
        `eval_dataset` may be a dataset, or the name of one in a dict passed to the Trainer.

        With `dataloader_persistent_workers`, the loader is reused (HF's `_eval_dataloaders`: by name, "eval"
        for any other), so its workers live on; unlike HF, only while the key means the same dataset."""
        if not self.config.data.dataloader_persistent_workers:
            return self._build_eval_dataloader(eval_dataset)
        from kiln.engine.data.trainer_loaders import cached_eval_loader

        return cached_eval_loader(self._eval_dataloaders, self.eval_dataset, eval_dataset, self._build_eval_dataloader)

    def _build_eval_dataloader(self, eval_dataset: Any) -> Iterable[Any]:
        name = f"eval_dataset {eval_dataset!r}" if isinstance(eval_dataset, str) else "eval_dataset"
        if isinstance(eval_dataset, str):
            named = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {}
            if eval_dataset not in named:
                raise KilnError(
                    f"No eval dataset named {eval_dataset!r}; the Trainer's eval_dataset dict has: {', '.join(named) or 'none'}."
                )
            eval_dataset = named[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise KilnError("evaluate() needs an eval_dataset: pass one to Trainer(...) or to evaluate().")
        check_eval_dataset(dataset, name, "pass evaluate() a dataset with items")
        if isinstance(dataset, Mapping):
            raise KilnError("get_eval_dataloader takes one dataset; evaluate() runs a dict of them one by one.")
        return self._sequential_loader(dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Iterable[Any]:
        if test_dataset is None:
            raise KilnError("predict() needs a test_dataset.")
        return self._sequential_loader(test_dataset)

    def _sequential_loader(self, dataset: Any) -> Iterable[Any]:
        from kiln.engine.data.dispatch_batches import per_rank_batch_size
        from kiln.engine.data.loaders import build_dataloader, is_sized

        s = self.strategy
        if isinstance(dataset, torch.utils.data.DataLoader):
            return s.process_dataloader(dataset)  # used as given
        cfg = self.config
        batch_size, drop_last = cfg.data.per_device_eval_batch_size, cfg.data.dataloader_drop_last
        batch_size = per_rank_batch_size(
            batch_size, cfg.data.split_batches, s.data_shards, "per_device_eval_batch_size"
        )
        sampler = None
        if is_sized(dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = SequentialDistributedSampler(
                len(dataset), s.data_shards, s.data_shard_rank, batch_size if drop_last else None, drop_last
            )
        dataset, collator = self._model_inputs(dataset, "Evaluation")  # remove_unused_columns (HF)
        loader = build_dataloader(
            dataset,
            batch_size,
            collator,
            cfg.data,
            cfg.seed,
            shuffle=False,
            num_replicas=s.data_shards,
            rank=s.data_shard_rank,
            sampler=sampler,
            drop_last=None if sampler is None else False,  # the sampler already dropped
            pin_memory=s.accelerator.pin_memory,
        )
        return s.process_dataloader(loader)

    # -- public API -------------------------------------------------------------------------
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
        override = eval_dataset is not None
        dataset = eval_dataset if override else self.eval_dataset
        if isinstance(dataset, Mapping):
            metrics: dict[str, float] = {}
            for name, ds in dataset.items():
                metrics.update(
                    self.evaluate(ds if override else name, ignore_keys, f"{metric_key_prefix}_{name}", **gen_kwargs)
                )
            return metrics
        self._gen_kwargs = gen_kwargs
        loader = self.get_eval_dataloader(eval_dataset)  # None: the Trainer's own (its loader may be reused)
        start = time.time()
        with self._memory_stage("eval"):  # ignored inside fit(): the train stage counts it
            output = self.evaluation_loop(
                loader,
                "Evaluation",
                prediction_loss_only=True if self.compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        assert output.metrics is not None and output.num_samples is not None  # evaluation_loop always sets both
        metrics = output.metrics
        metrics.update(self._speed_metrics(metric_key_prefix, start, output.num_samples, loader))
        self.memory_tracker.stop_and_update("eval", metrics)
        self.log(metrics)  # adds "epoch" to this very dict, so the caller sees it too (as in HF)
        self.control = self.callback_handler.call("on_evaluate", self.config, self.state, self.control, metrics=metrics)
        return metrics

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        """Numpy predictions and label_ids in dataset order (ragged sequences right-padded with
        `eval.padding_index`) and metrics (`<prefix>_loss` etc. when the data has labels)."""
        self._gen_kwargs = gen_kwargs
        loader = self.get_test_dataloader(test_dataset)
        start = time.time()
        with self._memory_stage("test"):
            output = self.evaluation_loop(
                loader, "Prediction", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
            )
        metrics, num_samples = output.metrics, output.num_samples
        assert metrics is not None and num_samples is not None  # evaluation_loop always sets both
        metrics.update(self._speed_metrics(metric_key_prefix, start, num_samples, loader))
        self.memory_tracker.stop_and_update("test", metrics)
        self.control = self.callback_handler.call("on_predict", self.config, self.state, self.control, metrics=metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=metrics)

    @contextlib.contextmanager
    def _memory_stage(self, stage: str) -> Iterator[None]:
        """HF's memory tracker stage around a loop; `stop_and_update(stage, metrics)` reports it after."""
        self.memory_tracker.start(stage)
        try:
            yield
        except BaseException:
            self.memory_tracker.stop(stage)
            raise

    def _speed_metrics(self, prefix: str, start: float, num_samples: int, loader: Any) -> dict[str, float]:
        from kiln.loggers.metrics import speed_metrics

        batch_size = getattr(loader, "batch_size", None) or self.config.data.per_device_eval_batch_size
        steps = math.ceil(num_samples / (batch_size * self.strategy.data_shards))
        return speed_metrics(prefix, start, num_samples=num_samples, num_steps=steps)

    # -- the loop ---------------------------------------------------------------------------
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
        cfg, s, e = self.config, self.strategy, self.config.eval
        loss_only = e.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        model = self.setup_model()
        self.callback_handler.objects["eval_dataloader"] = dataloader  # HF's evaluation_loop sets it here too
        if cfg.eval.compile:  # jit_mode_eval: the forward below runs through torch.compile
            model = self._eval_compiler(model, cfg.train)
        sampler = sampler_of(dataloader)
        distributed = s.data_shards > 1 and isinstance(sampler, SequentialDistributedSampler)
        if s.data_shards > 1 and not distributed:
            logger.warning(
                "Evaluating a loader without kiln's eval sampler on %d ranks: each rank reports its own shard.",
                s.data_shards,
            )
        per_batch, predicting = e.batch_eval_metrics, description == "Prediction"
        gatherer = OrderedGatherer.for_sampler(sampler, e.padding_index) if distributed else None
        acc: EvalAccumulator | ObjectAccumulator = EvalAccumulator(
            e.padding_index,
            e.do_concat_batches,
            e.accumulation_steps,
            gatherer=gatherer,
            gather_fn=s.all_gather if distributed and not per_batch else None,
        )
        if e.use_gather_object and not per_batch:  # non-tensor outputs: one all_gather_object at the end
            acc = ObjectAccumulator(
                s.all_gather_object if distributed else None,
                sampler.num_examples if distributed else None,
                e.padding_index,
            )
        metrics: Any = {}
        observed = 0
        dtype = self.precision.eval_dtype if not self.is_in_train else None  # HF: full-eval casting outside train()
        was_training = model.training
        self._eval_step_name = "predict_step" if predicting else "validation_step"
        model.eval()
        optimizer_mode(self.optimizer, "eval")  # schedule-free: evaluate the averaged weights, as HF does
        try:
            with s.eval_cast_context(self.model, dtype):
                for batch, is_last in with_last(dataloader):
                    batch = s.batch_to_device(batch)  # the precision plugin's input conversion included
                    if dtype is not None:
                        batch = cast_floating(batch, dtype)
                    bs = batch_size_of(batch)
                    loss, logits, labels = self.prediction_step(model, batch, loss_only, ignore_keys)
                    if logits is not None and self.preprocess_logits_for_metrics is not None:
                        logits = self.preprocess_logits_for_metrics(logits, labels)
                    inputs = inputs_for_metrics(self.model, batch) if e.include_inputs_for_metrics else None
                    outputs = step_outputs(loss, logits, labels, inputs, bs)
                    if per_batch:
                        if distributed:  # gathered here, once: rank-major, duplicates still in
                            outputs = gather_across_processes(outputs, s.all_gather, e.padding_index)
                        acc.add(outputs if predicting else {k: v for k, v in outputs.items() if k == "losses"})
                        if self.compute_metrics is not None and "predictions" in outputs and "label_ids" in outputs:
                            current = gatherer.drop_duplicates(outputs, observed) if gatherer is not None else outputs
                            metrics = self.compute_metrics(eval_prediction(current), compute_result=is_last)
                    else:
                        acc.add(outputs)
                    observed += bs
                    self.control = self.callback_handler.call("on_prediction_step", cfg, self.state, self.control)
        finally:
            model.train(was_training)
            if self.is_in_train:  # outside fit() it stays in eval mode, as in HF
                optimizer_mode(self.optimizer, "train")
        arrays = collected(acc.get_arrays())
        predictions, label_ids, losses = arrays.get("predictions"), arrays.get("label_ids"), arrays.get("losses")
        if not per_batch and self.compute_metrics is not None and predictions is not None and label_ids is not None:
            metrics = self.compute_metrics(EvalPrediction(predictions, label_ids, inputs=arrays.get("inputs")))
        metrics = {k: to_python(v) for k, v in dict(metrics or {}).items()}
        if losses is not None and losses.size:
            losses = losses.astype(np.float64)
            finite = np.isfinite(losses)
            if cfg.log.nan_inf_filter and finite.any():  # HF: nan/inf batches are left out of the mean
                losses = losses[finite]
            metrics["loss"] = float(losses.mean())
        prefix = f"{metric_key_prefix}_"
        metrics = {(k if k.startswith(prefix) else prefix + k): v for k, v in metrics.items()}
        num_samples = sampler.num_examples if isinstance(sampler, SequentialDistributedSampler) else observed
        return EvalLoopOutput(predictions=predictions, label_ids=label_ids, metrics=metrics, num_samples=num_samples)

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) for one batch, each possibly None (HF override point)."""
        with torch.no_grad(), self.precision.eval_context():
            if self.run.facts.training_module:
                return self._module_prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return self._hf_prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _module_prediction_step(
        self, model: Any, inputs: Any, loss_only: bool, ignore_keys: list[str] | None
    ) -> tuple[Any, Any, Any]:
        step = self._eval_step_name
        out = model(inputs, step=step)
        if isinstance(out, torch.Tensor):
            out = {"loss": out}
        if not isinstance(out, Mapping):
            raise TypeError(
                f"{step} must return a loss tensor or a dict with 'loss', 'logits' or 'predictions' "
                f"and 'labels'; got {type(out).__name__}."
            )
        loss = out.get("loss")
        loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        if loss_only:
            return loss, None, None
        logits = out["logits"] if out.get("logits") is not None else out.get("predictions")
        if ignore_keys and isinstance(logits, Mapping):
            logits = {k: v for k, v in logits.items() if k not in ignore_keys}
        labels = out.get("labels")
        if labels is None:  # as for HF models: labels straight from the batch
            labels = self._labels_from(inputs)
        return loss, nested_detach(logits), nested_detach(labels)

    def _labels_from(self, inputs: Any) -> Any:
        if (
            not isinstance(inputs, Mapping)
            or not self.label_names
            or any(inputs.get(k) is None for k in self.label_names)
        ):
            return None
        labels = tuple(inputs[k].detach() for k in self.label_names)
        return labels[0] if len(labels) == 1 else labels

    def _hf_prediction_step(
        self, model: Any, inputs: Any, loss_only: bool, ignore_keys: list[str] | None
    ) -> tuple[Any, Any, Any]:
        if ignore_keys is None:  # HF: the config's list, else the KV cache ("cache"; "past_key_values" before v5)
            config = getattr(self.model, "config", None)
            ignore_keys = [] if config is None else list(getattr(config, "keys_to_ignore_at_inference", ["cache"]))
        labels = self._labels_from(inputs)
        loss = outputs = None
        if labels is not None:  # HF: the model divides its summed loss by this batch's label count
            count = self.run.facts.count_items(inputs) if self.run.facts.model_divides(inputs) else None
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=count)
            loss = loss.mean().detach()
        if loss_only:
            return loss, None, None
        if self.config.eval.predict_with_generate:  # no forward without labels: decoders need targets
            from kiln.engine.evaluation.generation import generate_predictions

            return (
                loss,
                generate_predictions(
                    self.model,
                    self.forward_inputs(inputs) if isinstance(inputs, Mapping) else inputs,
                    set(self.label_names),
                    self.config.eval,
                    self._gen_kwargs,
                ),
                labels,
            )
        if outputs is None:
            outputs = model(**self.forward_inputs(inputs))
        if isinstance(outputs, Mapping):  # dicts and Transformers ModelOutputs
            logits: Any = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"] and v is not None)
        elif isinstance(outputs, (tuple, list)):
            logits = tuple(outputs[1:] if labels is not None else outputs)
        else:
            logits = (outputs,)
        logits = nested_detach(logits)
        return loss, (logits[0] if len(logits) == 1 else logits), labels

    # -- during training --------------------------------------------------------------------
    def evaluate_during_training(self, on_start: bool = False) -> dict[str, float]:
        """Evaluate, then update the best metric, `save_strategy: best` and a metric-driven scheduler.
        The sanity evaluation of `eval_on_start` does neither (HF)."""
        metrics = self.evaluate(ignore_keys=self._ignore_keys_for_eval)
        if on_start:
            return metrics
        self._report_to_trial(metrics)  # hyperparameter_search: the objective so far, and pruning
        improved = update_best(self.state, self.config, metrics)
        if self.config.save.strategy == "best":
            self.control.should_save = improved
        if self.run.scheduler_needs_metrics and self.lr_scheduler is not None:
            self.lr_scheduler.step(metrics[metric_key(self.config, metrics)])
        return metrics

    def greater_is_better(self) -> bool:
        return resolve_greater_is_better(self.config.eval)

    def _load_best_model(self) -> None:
        path = self.state.best_model_checkpoint
        if not path or not os.path.isdir(path):
            logger.warning("load_best_model_at_end: no best checkpoint was saved; keeping the last weights.")
            return
        self._load_from_checkpoint(path)

    def _load_from_checkpoint(self, path: str) -> None:
        """The model weights of `path` (a checkpoint or a save_model folder), without optimizer state (HF's name)."""
        from kiln.engine.checkpoint.weights import load_weights_for_eval

        load_weights_for_eval(self.strategy, self.setup_model(), self.model, path)

    def _check_eval_setup(self) -> None:
        """Before training: evaluation during training needs something to evaluate on (HF fails at init)."""
        e = self.config.eval
        custom_loader = type(self).get_eval_dataloader is not EvaluationMixin.get_eval_dataloader
        if (e.strategy != "no" or e.on_start) and self.eval_dataset is None and not custom_loader:
            raise KilnError(
                f"eval.strategy is {e.strategy!r}{' with eval_on_start' if e.on_start else ''} but the Trainer "
                "has no eval_dataset: pass eval_dataset=... or set eval_strategy='no'."
            )
        if (e.strategy != "no" or e.on_start) and not custom_loader:
            named = self.eval_dataset.items() if isinstance(self.eval_dataset, Mapping) else [(None, self.eval_dataset)]
            for name, dataset in named:
                check_eval_dataset(
                    dataset,
                    "eval_dataset" + (f" {name!r}" if name is not None else ""),
                    "pass a dataset with items, or set eval_strategy='no'",
                )

    # -- HF metric helpers ------------------------------------------------------------------
    def metrics_format(self, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Human-readable values (runtimes as h:mm:ss.xx, memory in MB, floats to 4 places)."""
        from kiln.loggers.metrics import metrics_format

        return metrics_format(dict(metrics))

    def log_metrics(self, split: str, metrics: Mapping[str, float]) -> None:
        """Print `***** <split> metrics *****` and aligned `key = value` lines, on global rank 0."""
        if self.strategy.is_global_zero:
            from kiln.loggers.metrics import format_log_metrics

            print(format_log_metrics(split, dict(metrics)), flush=True)

    def save_metrics(self, split: str, metrics: Mapping[str, float], combined: bool = True) -> None:
        """Write raw `<split>_results.json` (and merge it into `all_results.json`), on global rank 0."""
        if self.strategy.is_global_zero:
            write_metrics(self.config.output_dir, split, metrics, combined)
