"""Neptune (the `neptune` 1.x client HF's callback uses), offline: one run named `run_name`, the
flattened config under `parameters` (values Neptune cannot store, such as None, as their str()), every
metric as a series with its step under HF's sections (`train/loss`, `eval/loss`). Neptune writes the
run under `.neptune/offline/` in the working directory (or `NEPTUNE_DATA_DIRECTORY`); `neptune sync`
uploads it later, to the project `NEPTUNE_PROJECT` names. The run's source files, git state, console,
traceback and hardware metrics are not captured. An offline run cannot be reopened, so logs after
the run ended (an evaluate() after fit()) go to a second run of the same name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require, run_name

if TYPE_CHECKING:
    from omegaconf import DictConfig


@LOGGERS.register("neptune")
class NeptuneLogger(Logger):
    name = "neptune"
    package = "neptune"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("neptune", "neptune", "report_to: neptune")
        self.run: Any | None = None

    def _start(self) -> Any:
        if self.run is None:
            import neptune

            self.run = neptune.init_run(
                mode="offline",
                name=self.trial_name or run_name(self.config),
                tags=[run_name(self.config)] if self.trial_name else None,
                source_files=[],
                git_ref=False,
                capture_stdout=False,
                capture_stderr=False,
                capture_traceback=False,
                capture_hardware_metrics=False,
            )
        return self.run

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from neptune.utils import stringify_unsupported

        values = {k: str(v) if v is None else v for k, v in {**params, **(self.trial_params or {})}.items()}
        self._start()["parameters"] = stringify_unsupported(values)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        run = self._start()
        for key, value in metrics.items():
            run[grouped_name(key)].append(value, step=step)

    def finalize(self, status: str) -> None:
        if self.run is not None:
            if status != "success":
                self.run["sys/failed"] = True
            self.run.stop()
            self.run = None
