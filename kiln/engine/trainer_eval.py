"""The evaluation half of the Trainer: `evaluate`, `predict`, `prediction_step` (HF override
points), evaluation during training, best-model tracking and HF's metric files."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch

from kiln.engine.errors import KilnError
from kiln.engine.gather import EvalAccumulator, OrderedGatherer, SequentialDistributedSampler, nested_detach
from kiln.engine.outputs import EvalLoopOutput, EvalPrediction, PredictionOutput
from kiln.engine.tensors import batch_size_of

if TYPE_CHECKING:
    from kiln.engine.trainer import Trainer


class EvaluationMixin:
    """Mixed into Trainer; `self` is the Trainer."""

    # -- dataloaders ------------------------------------------------------------------------
    def get_eval_dataloader(self: "Trainer", eval_dataset: Any = None) -> Any:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise KilnError("evaluate() needs an eval_dataset: pass one to Trainer(...) or to evaluate().")
        return self._sequential_loader(dataset)

    def get_test_dataloader(self: "Trainer", test_dataset: Any) -> Any:
        return self._sequential_loader(test_dataset)

    def _sequential_loader(self: "Trainer", dataset: Any) -> Any:
        from kiln.engine.data import build_dataloader, is_sized

        if isinstance(dataset, torch.utils.data.DataLoader):
            return dataset
        cfg, s = self.config, self.strategy
        sampler = None
        if is_sized(dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = SequentialDistributedSampler(len(dataset), s.data_parallel_size, s.data_parallel_rank)
        return build_dataloader(dataset, cfg.data.per_device_eval_batch_size, self.data_collator, cfg.data, cfg.seed,
                                shuffle=False, num_replicas=s.data_parallel_size, rank=s.data_parallel_rank, sampler=sampler)

    # -- public API -------------------------------------------------------------------------
    def evaluate(self: "Trainer", eval_dataset: Any = None, ignore_keys: Optional[list[str]] = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Run evaluation; a dict of datasets is evaluated one by one (`eval_<name>_loss`, ...)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, Mapping):
            metrics: dict[str, float] = {}
            for name, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        loader = self.get_eval_dataloader(dataset)
        start = time.perf_counter()
        output = self.evaluation_loop(loader, "Evaluation", prediction_loss_only=True if self.compute_metrics is None else None,
                                      ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        output.metrics.update(_speed(metric_key_prefix, start, output.num_samples, math.ceil(output.num_samples / max(self.config.data.per_device_eval_batch_size * self.strategy.data_parallel_size, 1))))
        self.log(dict(output.metrics))
        self.control = self.callback_handler.call("on_evaluate", self.config, self.state, self.control, metrics=output.metrics)
        return output.metrics

    def predict(self: "Trainer", test_dataset: Any, ignore_keys: Optional[list[str]] = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        loader = self.get_test_dataloader(test_dataset)
        start = time.perf_counter()
        output = self.evaluation_loop(loader, "Prediction", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, step="predict_step")
        output.metrics.update(_speed(metric_key_prefix, start, output.num_samples, None))
        self.control = self.callback_handler.call("on_predict", self.config, self.state, self.control, metrics=output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    # -- the loop ---------------------------------------------------------------------------
    def evaluation_loop(self: "Trainer", dataloader: Any, description: str, prediction_loss_only: Optional[bool] = None,
                        ignore_keys: Optional[list[str]] = None, metric_key_prefix: str = "eval",
                        step: str = "validation_step") -> EvalLoopOutput:
        cfg, s = self.config, self.strategy
        e = cfg.eval
        loss_only = prediction_loss_only if prediction_loss_only is not None else e.prediction_loss_only
        model = self._setup_model()
        cast = self.precision.eval_dtype if not self.is_in_train else None
        if cast is not None:
            self.model.to(cast)
        was_training = model.training
        model.eval()
        sampler = getattr(dataloader, "sampler", None)
        distributed = s.data_parallel_size > 1 and isinstance(sampler, SequentialDistributedSampler)
        gatherer = OrderedGatherer.for_sampler(sampler, e.padding_index) if distributed else None
        acc = EvalAccumulator(e.padding_index, e.do_concat_batches, e.accumulation_steps,
                              gather_fn=s.all_gather if distributed and not e.batch_eval_metrics else None,
                              gatherer=gatherer if not e.batch_eval_metrics else None)
        metrics: dict[str, Any] = {}
        losses_sum, samples = 0.0, 0
        self._eval_step_name = step
        n_batches = len(dataloader) if hasattr(dataloader, "__len__") else None
        try:
            for i, batch in enumerate(dataloader):
                batch = s.batch_to_device(batch)
                bs = batch_size_of(batch)
                loss, logits, labels = self.prediction_step(model, batch, loss_only, ignore_keys)
                inputs = batch.get("input_ids") if e.include_inputs_for_metrics and isinstance(batch, Mapping) else None
                if logits is not None and self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, labels)
                outputs = {k: v for k, v in (("losses", None if loss is None else loss.detach().float().reshape(1).repeat(bs)),
                                             ("predictions", logits), ("label_ids", labels), ("inputs", inputs)) if v is not None}
                if e.batch_eval_metrics:
                    if distributed:
                        from kiln.engine.gather import gather_across_processes

                        rows_before = i * bs
                        outputs = gatherer.drop_duplicates(gather_across_processes(outputs, s.all_gather, e.padding_index), rows_before)  # type: ignore[union-attr]
                    if "losses" in outputs:
                        losses_sum += float(outputs["losses"].double().sum())
                        samples += int(outputs["losses"].numel())
                    if self.compute_metrics is not None and "predictions" in outputs and "label_ids" in outputs:
                        last = n_batches is not None and i == n_batches - 1
                        metrics = self.compute_metrics(_prediction(outputs), compute_result=last) or {}
                else:
                    acc.add(outputs)
                self.control = self.callback_handler.call("on_prediction_step", cfg, self.state, self.control)
        finally:
            if cast is not None:
                self.model.to(torch.float32)
            model.train(was_training)
        arrays = acc.get_arrays() if not e.batch_eval_metrics else None
        predictions = label_ids = None
        if isinstance(arrays, Mapping):
            predictions, label_ids = arrays.get("predictions"), arrays.get("label_ids")
            if "losses" in arrays:
                metrics_loss = arrays["losses"]
                losses_sum, samples = float(metrics_loss.astype("float64").sum()), int(metrics_loss.size)
            if self.compute_metrics is not None and predictions is not None and label_ids is not None:
                metrics = self.compute_metrics(_prediction(arrays)) or {}
        elif isinstance(arrays, list) and arrays:  # do_concat_batches=False: one entry per batch
            predictions = [a.get("predictions") for a in arrays]
            label_ids = [a.get("label_ids") for a in arrays]
            losses = [a["losses"] for a in arrays if "losses" in a]
            if losses:
                losses_sum, samples = float(sum(l.astype("float64").sum() for l in losses)), sum(l.size for l in losses)
            if self.compute_metrics is not None and predictions[0] is not None and label_ids[0] is not None:
                metrics = self.compute_metrics(EvalPrediction(predictions, label_ids)) or {}
        metrics = {k: (v.item() if hasattr(v, "item") else v) for k, v in dict(metrics).items()}
        if samples:
            metrics["loss"] = losses_sum / samples
        num_samples = samples or (len(dataloader.dataset) if hasattr(getattr(dataloader, "dataset", None), "__len__") else 0)
        prefixed = {(k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}"): v for k, v in metrics.items()}
        return EvalLoopOutput(predictions=predictions, label_ids=label_ids, metrics=prefixed, num_samples=num_samples)

    def prediction_step(self: "Trainer", model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: Optional[list[str]] = None) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) for one batch, each possibly None."""
        with torch.no_grad(), self.precision.eval_context():
            if self._training_module:
                out = model(inputs, step=getattr(self, "_eval_step_name", "validation_step"))
                if isinstance(out, torch.Tensor):
                    return out.detach(), None, None
                loss = out.get("loss")
                logits = out.get("logits", out.get("predictions"))
                labels = out.get("labels")
                if prediction_loss_only:
                    return (loss.detach() if loss is not None else None), None, None
                return (loss.detach() if loss is not None else None), nested_detach(logits), nested_detach(labels)
            return self._hf_prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _hf_prediction_step(self: "Trainer", model: Any, inputs: Any, loss_only: bool, ignore_keys: Optional[list[str]]) -> tuple[Any, Any, Any]:
        if ignore_keys is None:
            ignore_keys = list(getattr(getattr(self.model, "config", None), "keys_to_ignore_at_inference", []) or [])
        has_labels = all(inputs.get(k) is not None for k in self.label_names)
        labels = None
        if has_labels:
            labels = tuple(inputs[k].detach() for k in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        loss = None
        if has_labels:
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
            loss = loss.mean().detach()
        else:
            outputs = model(**self._remove_unused(inputs))
        if loss_only:
            return loss, None, None
        if self.config.eval.predict_with_generate and hasattr(self.model, "generate"):
            from kiln.engine.generation import generate_predictions

            return loss, generate_predictions(self, inputs), labels
        if isinstance(outputs, Mapping) or hasattr(outputs, "keys"):
            logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"] and v is not None)
        else:
            logits = tuple(outputs[1:] if has_labels else outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        logits = nested_detach(logits)
        return loss, (logits[0] if len(logits) == 1 else logits), labels

    # -- during training --------------------------------------------------------------------
    def _evaluate_during_training(self: "Trainer") -> dict[str, float]:
        metrics = self.evaluate(ignore_keys=getattr(self, "_ignore_keys_for_eval", None))
        improved = self._update_best(metrics)
        if self.config.save.strategy == "best":
            self.control.should_save = improved
        if self._scheduler_needs_metrics and self.lr_scheduler is not None:
            self.lr_scheduler.step(metrics[self._best_metric_key(metrics)])
        self.model_wrapped.train()
        return metrics

    def _best_metric_key(self: "Trainer", metrics: Mapping[str, float]) -> str:
        name = self.config.eval.metric_for_best_model or "loss"
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KilnError(f"metric_for_best_model is {name!r} but evaluation returned no {key!r} (it returned: {', '.join(sorted(metrics))}).")
        return key

    def greater_is_better(self: "Trainer") -> bool:
        e = self.config.eval
        if e.greater_is_better is not None:
            return bool(e.greater_is_better)
        return (e.metric_for_best_model or "loss") not in ("loss", "eval_loss")

    def _update_best(self: "Trainer", metrics: Mapping[str, float]) -> bool:
        e = self.config.eval
        if not (e.metric_for_best_model or e.load_best_model_at_end or self.config.save.strategy == "best"):
            return False
        value = float(metrics[self._best_metric_key(metrics)])
        best = self.state.best_metric
        better = best is None or (value > best if self.greater_is_better() else value < best)
        if better:
            self.state.best_metric, self.state.best_global_step = value, self.state.global_step
        return better

    def _load_best_model(self: "Trainer") -> None:
        path = self.state.best_model_checkpoint
        if not path or not os.path.isdir(path):
            return
        self.strategy.checkpoint_io().load(path, self.model, None, load_optimizer=False)

    # -- HF metric helpers ------------------------------------------------------------------
    def metrics_format(self: "Trainer", metrics: Mapping[str, float]) -> dict[str, Any]:
        from kiln.loggers.metrics import metrics_format

        return metrics_format(dict(metrics))

    def log_metrics(self: "Trainer", split: str, metrics: Mapping[str, float]) -> None:
        if self.strategy.is_global_zero:
            from kiln.loggers.metrics import format_log_metrics

            print(format_log_metrics(split, dict(metrics)), flush=True)

    def save_metrics(self: "Trainer", split: str, metrics: Mapping[str, float], combined: bool = True) -> None:
        """Write `<split>_results.json` (and merge into all_results.json), raw numbers, rank 0."""
        if not self.strategy.is_global_zero:
            return
        os.makedirs(self.config.output_dir, exist_ok=True)
        with open(os.path.join(self.config.output_dir, f"{split}_results.json"), "w") as fh:
            json.dump(dict(metrics), fh, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.config.output_dir, "all_results.json")
            merged = json.load(open(path)) if os.path.exists(path) else {}
            merged.update(metrics)
            with open(path, "w") as fh:
                json.dump(merged, fh, indent=4, sort_keys=True)


def _prediction(arrays: Mapping[str, Any]) -> EvalPrediction:
    return EvalPrediction(predictions=arrays.get("predictions"), label_ids=arrays.get("label_ids"), inputs=arrays.get("inputs"),
                          losses=arrays.get("losses"))


def _speed(prefix: str, start: float, num_samples: Optional[int], num_steps: Optional[int]) -> dict[str, float]:
    runtime = time.perf_counter() - start
    out = {f"{prefix}_runtime": round(runtime, 4)}
    if num_samples:
        out[f"{prefix}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps:
        out[f"{prefix}_steps_per_second"] = round(num_steps / runtime, 3)
    return out
