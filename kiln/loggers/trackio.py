"""Trackio, local: one run named `run_name` in project `log.project` (default `kiln`), with the
flattened config and every metric against `train/global_step` (HF's layout: `train/loss`,
`eval/loss`). Trackio keeps a project's runs in one SQLite database in its folder (`TRACKIO_DIR`,
default `~/.cache/huggingface/trackio`); `trackio show` opens its dashboard. kiln passes no Space,
server or bucket, so the run stays on this machine unless Trackio's own environment names one
(`TRACKIO_SPACE_ID`, `TRACKIO_SERVER_URL`); Trackio's CPU and GPU sampling is off."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require, run_name, setting

if TYPE_CHECKING:
    from omegaconf import DictConfig

STEP = "train/global_step"


@LOGGERS.register("trackio")
class TrackioLogger(Logger):
    name = "trackio"
    package = "trackio"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("trackio", "trackio", "report_to: trackio")
        self.project: str = setting(config, "project", None, "kiln")
        self.run: Any | None = None
        self.started = False  # a later log (evaluate() after fit()) continues the run
        self.params: dict[str, Any] = {}

    def _start(self) -> Any:
        if self.run is None:
            import trackio

            self.run = trackio.init(
                project=self.project,
                name=self.trial_name or run_name(self.config),
                group=run_name(self.config) if self.trial_name else None,
                config=self.params or None,
                resume="allow" if self.started else "never",
                embed=False,
                auto_log_gpu=False,
                auto_log_cpu=False,
            )
            self.started = True
        return self.run

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
            self.started = False
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        # LoggerCallback logs the config once per run, before any metric: trackio.init takes it
        self.params = {**params, **(self.trial_params or {})}
        self._start()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._start().log({**{grouped_name(k): v for k, v in metrics.items()}, STEP: step}, step=step)

    def finalize(self, status: str) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
