"""Aim: one run in the Aim repository `<output_dir>/.aim` (`aim up --repo <output_dir>` browses it),
experiment `log.project` (default `kiln`), named `run_name`, with the flattened config under
`hparams` and every metric tracked with its step, its section as the context (`loss` with
`{"subset": "train"}` or `{"subset": "eval"}`, as Aim's own HF callback does). Aim's system monitor
and terminal capture are off."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require, run_name, setting

if TYPE_CHECKING:
    from omegaconf import DictConfig


@LOGGERS.register("aim")
class AimLogger(Logger):
    name = "aim"
    package = "aim"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("aim", "aim", "report_to: aim")
        self.repo = os.path.abspath(str(config.output_dir))
        self.experiment: str = setting(config, "project", None, "kiln")
        self.run: Any | None = None
        self.run_hash: str | None = None  # kept after finalize, so later logs continue the run

    def _start(self) -> Any:
        if self.run is None:
            from aim import Run

            os.makedirs(self.repo, exist_ok=True)
            self.run = Run(
                run_hash=self.run_hash,
                repo=self.repo,
                experiment=self.experiment,
                system_tracking_interval=None,
                log_system_params=False,
                capture_terminal_logs=False,
            )
            if self.run_hash is None:
                self.run.name = self.trial_name or run_name(self.config)
                if self.trial_name:
                    self.run.add_tag(run_name(self.config))
                self.run_hash = self.run.hash
        return self.run

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
            self.run_hash = None
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._start()["hparams"] = {**params, **(self.trial_params or {})}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        run = self._start()
        for key, value in metrics.items():
            subset, name = grouped_name(key).split("/", 1)
            run.track(value, name=name, step=step, context={"subset": subset})

    def finalize(self, status: str) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None
