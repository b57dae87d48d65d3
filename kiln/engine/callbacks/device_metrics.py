"""HF's `debug: tpu_metrics_debug`: the device runtime's metrics report (XLA: compilations, their
time, device<->host transfers) printed after every evaluation, as HF does, and at the end of training,
on the main process. The report comes from the strategy's accelerator, so nothing here knows XLA;
the config check refuses the option with strategies whose device keeps no such report."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState


class DeviceMetricsReport(Callback):
    def __init__(self, report: Callable[[], str | None], main_process: bool = True) -> None:
        self.report = report
        self.main_process = main_process

    def _print(self) -> None:
        text = self.report()
        if self.main_process and text:
            print(text, flush=True)

    def on_evaluate(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._print()

    def on_train_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._print()
