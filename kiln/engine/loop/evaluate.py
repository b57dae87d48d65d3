"""`evaluate` and `predict` (HF's public API; the Trainer's methods run these): the loader from the
Trainer's `get_eval_dataloader` / `get_test_dataloader`, one pass of its `evaluation_loop`, then speed and
memory figures, and the callbacks' `on_evaluate` / `on_predict`. Each goes through the Trainer's override
points, so a subclass's are honoured."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kiln.engine.evaluation.outputs import PredictionOutput

if TYPE_CHECKING:
    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.engine.hooks import EvalHooks
    from kiln.engine.run import Run
    from kiln.strategies.base import Strategy


class _EvalCall:
    """What evaluate and predict share: the objects they run with, HF's memory stage and speed metrics."""

    def __init__(
        self,
        hooks: EvalHooks,
        run: Run,
        strategy: Strategy,
        callbacks: CallbackHandler,
        config: Any,
        memory_tracker: Any,
    ) -> None:
        self.hooks, self.run, self.strategy = hooks, run, strategy
        self.callbacks, self.config, self.memory_tracker = callbacks, config, memory_tracker

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


class EvaluateLoop(_EvalCall):
    """`evaluate`: metrics logged and handed to `on_evaluate`."""

    def run_evaluate(
        self, eval_dataset: Any, ignore_keys: list[str] | None, metric_key_prefix: str, gen_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        """`Trainer.evaluate`; a dict of datasets is evaluated one by one through the Trainer's `evaluate`."""
        hooks, run = self.hooks, self.run
        override = eval_dataset is not None
        dataset = eval_dataset if override else hooks.eval_dataset
        if isinstance(dataset, Mapping):
            metrics: dict[str, float] = {}
            for name, ds in dataset.items():
                metrics.update(
                    hooks.evaluate(ds if override else name, ignore_keys, f"{metric_key_prefix}_{name}", **gen_kwargs)
                )
            return metrics
        run.gen_kwargs = gen_kwargs
        loader = hooks.get_eval_dataloader(eval_dataset)  # None: the Trainer's own (its loader may be reused)
        start = time.time()
        with self._memory_stage("eval"):  # ignored inside fit(): the train stage counts it
            output = hooks.evaluation_loop(
                loader,
                "Evaluation",
                prediction_loss_only=True if hooks.compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        assert output.metrics is not None and output.num_samples is not None  # evaluation_loop always sets both
        metrics = output.metrics
        metrics.update(self._speed_metrics(metric_key_prefix, start, output.num_samples, loader))
        self.memory_tracker.stop_and_update("eval", metrics)
        hooks.log(metrics)  # adds "epoch" to this very dict, so the caller sees it too (as in HF)
        run.control = self.callbacks.call("on_evaluate", self.config, run.state, run.control, metrics=metrics)
        return metrics


class PredictLoop(_EvalCall):
    """`predict`: predictions, label ids and metrics, handed to `on_predict` (not logged, as in HF)."""

    def run_predict(
        self, test_dataset: Any, ignore_keys: list[str] | None, metric_key_prefix: str, gen_kwargs: dict[str, Any]
    ) -> PredictionOutput:
        """`Trainer.predict`."""
        hooks, run = self.hooks, self.run
        run.gen_kwargs = gen_kwargs
        loader = hooks.get_test_dataloader(test_dataset)
        start = time.time()
        with self._memory_stage("test"):
            output = hooks.evaluation_loop(
                loader, "Prediction", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
            )
        metrics, num_samples = output.metrics, output.num_samples
        assert metrics is not None and num_samples is not None  # evaluation_loop always sets both
        metrics.update(self._speed_metrics(metric_key_prefix, start, num_samples, loader))
        self.memory_tracker.stop_and_update("test", metrics)
        run.control = self.callbacks.call("on_predict", self.config, run.state, run.control, metrics=metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=metrics)
