"""SwanLab, offline: one experiment named `run_name` in project `log.project` (default `kiln`), with
the flattened config and every metric with its step under HF's sections (`train/loss`, `eval/loss`),
written under `<output_dir>/swanlog/run-<date>-<id>/`; `swanlab sync <folder>` uploads it later.
Offline by construction, and SwanLab's probes (hardware, runtime, pip requirements, git, system
monitor) and console capture are off."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require, run_name, setting

if TYPE_CHECKING:
    from omegaconf import DictConfig


@LOGGERS.register("swanlab")
class SwanLabLogger(Logger):
    name = "swanlab"
    package = "swanlab"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("swanlab", "swanlab", "report_to: swanlab")
        self.log_dir = os.path.join(os.path.abspath(str(config.output_dir)), "swanlog")
        self.project: str = setting(config, "project", None, "kiln")
        self.run: Any | None = None
        self.params: dict[str, Any] = {}

    def _start(self) -> Any:
        if self.run is None:
            import swanlab

            settings = swanlab.Settings(
                probe=swanlab.Settings.Probe(
                    hardware=False, runtime=False, requirements=False, conda=False, git=False, monitor=False
                ),
                terminal=swanlab.Settings.Terminal(proxy_type="none"),
            )
            os.makedirs(self.log_dir, exist_ok=True)
            self.run = swanlab.init(
                mode="offline",
                log_dir=self.log_dir,
                project=self.project,
                name=self.trial_name or run_name(self.config),
                group=run_name(self.config) if self.trial_name else None,
                config=self.params or None,
                settings=settings,
            )
        return self.run

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        # LoggerCallback logs the config once per run, before any metric: swanlab.init takes it
        # SwanLab stores None as an empty mapping: kiln gives it as "None", as TensorBoard shows it
        self.params = {k: "None" if v is None else v for k, v in {**params, **(self.trial_params or {})}.items()}
        self._start()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._start().log({grouped_name(k): v for k, v in metrics.items()}, step=step)

    def finalize(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(state="success" if status == "success" else "crashed")
            self.run = None
