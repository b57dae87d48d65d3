"""The evaluation loop (HF's `evaluation_loop`; `Trainer.evaluation_loop` runs it): one pass over a loader,
shared by evaluate ("Evaluation": TrainingModule.validation_step) and predict ("Prediction": predict_step),
with or without labels.

One eval step, as data flows (the tensor logic lives in `kiln.engine.evaluation` gather.py, nested.py and accumulator.py):

    batch -> strategy.batch_to_device -> precision.convert_input -> prediction_step -> (loss, logits, labels)
          -> preprocess_logits_for_metrics(logits, labels) -> EvalAccumulator.add({losses, predictions,
             label_ids[, inputs]})  (gathered across ranks, moved to CPU numpy every eval_accumulation_steps)
    end:  arrays in dataset order -> compute_metrics(EvalPrediction) -> metrics prefixed `<prefix>_`

With `batch_eval_metrics`, `compute_metrics(EvalPrediction, compute_result=is_last_batch)` is called
on every batch instead and predictions are not kept (except by `predict`, as in HF).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.engine.data.samplers import SequentialDistributedSampler
from kiln.engine.evaluation.accumulator import EvalAccumulator
from kiln.engine.evaluation.batches import collected, inputs_for_metrics, sampler_of, with_last
from kiln.engine.evaluation.gather import OrderedGatherer, gather_across_processes
from kiln.engine.evaluation.object_gather import ObjectAccumulator
from kiln.engine.evaluation.outputs import EvalLoopOutput, EvalPrediction, eval_prediction, step_outputs, to_python
from kiln.engine.run import setup_for_eval
from kiln.optim.optimizers import optimizer_mode
from kiln.precision.base import cast_floating
from kiln.utils.tensors import batch_size_of

if TYPE_CHECKING:
    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.engine.hooks import EvalHooks
    from kiln.engine.run import Run
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy

logger = logging.getLogger(__name__)


class EvaluationLoop:
    """One pass over a loader: `prediction_step` (the Trainer's, so an override is honoured) on every batch,
    outputs gathered in dataset order, then `compute_metrics`. `in_train`: called from inside `fit()`, where
    the model goes back to train mode after and the full-eval dtype cast does not apply (HF)."""

    def __init__(
        self,
        hooks: EvalHooks,
        run: Run,
        strategy: Strategy,
        precision: Precision,
        callbacks: CallbackHandler,
        config: Any,
        *,
        in_train: bool,
    ) -> None:
        self.hooks, self.run, self.strategy, self.precision = hooks, run, strategy, precision
        self.callbacks, self.config, self.in_train = callbacks, config, in_train

    def run_pass(
        self,
        dataloader: Iterable[Any],
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        hooks, run, cfg, s, e = self.hooks, self.run, self.config, self.strategy, self.config.eval
        loss_only = e.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        model = setup_for_eval(run, s, cfg)
        self.callbacks.objects["eval_dataloader"] = dataloader  # HF's evaluation_loop sets it here too
        if cfg.eval.compile:  # jit_mode_eval: the forward below runs through torch.compile
            model = run.eval_compiler(model, cfg.train)
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
        dtype = self.precision.eval_dtype if not self.in_train else None  # HF: full-eval casting outside train()
        was_training = model.training
        run.eval_step = "predict_step" if predicting else "validation_step"
        model.eval()
        optimizer_mode(run.optimizer, "eval")  # schedule-free: evaluate the averaged weights, as HF does
        try:
            with s.eval_cast_context(run.model, dtype):
                for batch, is_last in with_last(dataloader):
                    batch = s.batch_to_device(batch)  # the precision plugin's input conversion included
                    if dtype is not None:
                        batch = cast_floating(batch, dtype)
                    bs = batch_size_of(batch)
                    loss, logits, labels = hooks.prediction_step(model, batch, loss_only, ignore_keys)
                    if logits is not None and hooks.preprocess_logits_for_metrics is not None:
                        logits = hooks.preprocess_logits_for_metrics(logits, labels)
                    inputs = inputs_for_metrics(run.model, batch) if e.include_inputs_for_metrics else None
                    outputs = step_outputs(loss, logits, labels, inputs, bs)
                    if per_batch:
                        if distributed:  # gathered here, once: rank-major, duplicates still in
                            outputs = gather_across_processes(outputs, s.all_gather, e.padding_index)
                        acc.add(outputs if predicting else {k: v for k, v in outputs.items() if k == "losses"})
                        if hooks.compute_metrics is not None and "predictions" in outputs and "label_ids" in outputs:
                            current = gatherer.drop_duplicates(outputs, observed) if gatherer is not None else outputs
                            metrics = hooks.compute_metrics(eval_prediction(current), compute_result=is_last)
                    else:
                        acc.add(outputs)
                    observed += bs
                    run.control = self.callbacks.call("on_prediction_step", cfg, run.state, run.control)
        finally:
            model.train(was_training)
            if self.in_train:  # outside fit() it stays in eval mode, as in HF
                optimizer_mode(run.optimizer, "train")
        arrays = collected(acc.get_arrays())
        predictions, label_ids, losses = arrays.get("predictions"), arrays.get("label_ids"), arrays.get("losses")
        if not per_batch and hooks.compute_metrics is not None and predictions is not None and label_ids is not None:
            metrics = hooks.compute_metrics(EvalPrediction(predictions, label_ids, inputs=arrays.get("inputs")))
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
