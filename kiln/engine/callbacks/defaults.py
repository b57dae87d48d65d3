"""The callbacks every Trainer starts with: the flow (HF's DefaultFlowCallback), the console
(progress bar or printer), the debug helpers the config asks for, and on global rank 0 the one
callback that feeds the loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback, DefaultFlowCallback

if TYPE_CHECKING:
    from kiln.strategies.base import Strategy


def default_callbacks(config: Any, strategy: Strategy) -> list[Callback]:
    from kiln.engine.callbacks.progress import console_callbacks

    cbs: list[Callback] = [DefaultFlowCallback(), *console_callbacks(config)]
    cbs += _debug_callbacks(config, strategy)
    if strategy.is_global_zero:  # exactly one tracker run per job, by construction
        cbs.append(logger_callback(config))
    return cbs


def logger_callback(config: Any) -> Callback:
    """The callback that sends the run's logs to the loggers `report_to` / `log.history` name."""
    from kiln.engine.callbacks.loggers import LoggerCallback
    from kiln.loggers.build import build_loggers

    return LoggerCallback(config, build_loggers(config))


def _debug_callbacks(config: Any, strategy: Strategy) -> list[Callback]:
    """`debug: underflow_overflow` / `tpu_metrics_debug` and `torch_empty_cache_steps` (HF's TrainingArguments),
    and kiln's `profile:` and `memory_snapshot:`."""
    cbs: list[Callback] = []
    if "underflow_overflow" in config.train.debug:
        from kiln.engine.callbacks.debug_overflow import DebugUnderflowOverflow

        cbs.append(DebugUnderflowOverflow())
    if "tpu_metrics_debug" in config.train.debug:  # validated: only with a device that keeps a report
        from kiln.engine.callbacks.device_metrics import DeviceMetricsReport

        cbs.append(DeviceMetricsReport(strategy.accelerator.metrics_report, strategy.is_global_zero))
    from kiln.engine.callbacks.memory_snapshot import memory_snapshot_callback
    from kiln.engine.callbacks.profiler import profiler_callback

    for build in (profiler_callback, memory_snapshot_callback):
        callback = build(config, strategy.global_rank, strategy.root_device.type)
        if callback is not None:
            cbs.append(callback)
    if config.train.torch_empty_cache_steps:
        from kiln.engine.callbacks.empty_cache import EmptyCacheCallback, device_empty_cache

        cbs.append(EmptyCacheCallback(config.train.torch_empty_cache_steps, device_empty_cache(strategy.root_device)))
    return cbs
