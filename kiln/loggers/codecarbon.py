"""CodeCarbon: the energy and CO2 emissions of training, measured by its offline tracker from the
start of training to its end and appended as one row to `<output_dir>/emissions.csv` (HF's place),
with `run_name` as the project (each hyperparameter-search trial its own row, named after the trial).
It logs no metrics or hyperparameters: it measures. The offline tracker never asks a web service
where the machine is; CodeCarbon reads the country for its carbon intensity from its own settings
(`country_iso_code` in `.codecarbon.config` or `CODECARBON_COUNTRY_ISO_CODE`), else it uses a world
average."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, require, run_name

if TYPE_CHECKING:
    from omegaconf import DictConfig


@LOGGERS.register("codecarbon")
class CodeCarbonLogger(Logger):
    name = "codecarbon"
    package = "codecarbon"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("codecarbon", "codecarbon", "report_to: codecarbon")
        self.output_dir = os.path.abspath(str(config.output_dir))
        self.tracker: Any | None = None

    def resume(self, step: int) -> None:
        """Training starts: so does the measurement."""
        if self.tracker is None:
            from codecarbon import OfflineEmissionsTracker

            os.makedirs(self.output_dir, exist_ok=True)
            self.tracker = OfflineEmissionsTracker(
                project_name=self.trial_name or run_name(self.config),
                output_dir=self.output_dir,
                output_file="emissions.csv",
                save_to_file=True,
            )
            self.tracker.start()

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
        super().set_trial(name, params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Nothing to record: CodeCarbon measures energy, not the run's metrics."""

    def finalize(self, status: str) -> None:
        if self.tracker is not None:
            self.tracker.stop()  # writes the row
            self.tracker = None
