"""Comet, offline: one experiment archive per run, `<output_dir>/comet/<id>.zip`, holding the
flattened config as parameters and every metric with its step, under HF's sections (`train/loss`,
`eval/loss`), named `run_name`. `comet upload <archive>` sends it to Comet later.

Offline by construction: kiln writes an `OfflineExperiment`, and switches off what Comet does on its
own when imported (patching torch and TensorBoard for auto-logging, reporting its errors to Sentry)
unless the environment already says otherwise (`COMET_DISABLE_AUTO_LOGGING`,
`COMET_ERROR_TRACKING_ENABLE`), and everything it collects about the machine, the code and git."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require, run_name, setting

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Read by comet_ml when it is imported, so they cannot go through its constructor.
_IMPORT_SETTINGS = {"COMET_DISABLE_AUTO_LOGGING": "1", "COMET_ERROR_TRACKING_ENABLE": "false"}

# Everything an experiment collects besides what kiln logs: off.
_COLLECT_NOTHING: dict[str, Any] = dict(
    log_code=False,
    log_graph=False,
    auto_param_logging=False,
    auto_metric_logging=False,
    parse_args=False,
    auto_output_logging=None,
    log_env_details=False,
    log_git_metadata=False,
    log_git_patch=False,
    log_env_gpu=False,
    log_env_host=False,
    log_env_cpu=False,
    log_env_network=False,
    log_env_disk=False,
    display_summary_level=0,
)

_CONTINUE_ARGS = (
    "log_code",
    "log_graph",
    "auto_param_logging",
    "auto_metric_logging",
    "parse_args",
    "auto_output_logging",
    "log_env_details",
    "log_git_metadata",
    "log_git_patch",
    "log_env_gpu",
    "log_env_host",
    "log_env_cpu",
    "log_env_disk",
    "display_summary_level",
)


@LOGGERS.register("comet_ml")
class CometLogger(Logger):
    name = "comet_ml"
    package = "comet_ml"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("comet_ml", "comet", "report_to: comet_ml")
        self.directory = os.path.join(os.path.abspath(str(config.output_dir)), "comet")
        self.project: str = setting(config, "project", "COMET_PROJECT_NAME", "kiln")
        self.experiment: Any | None = None
        self.key: str | None = None  # kept after finalize: later logs (evaluate() after fit()) continue it

    def capture(self) -> None:
        for key, value in _IMPORT_SETTINGS.items():
            os.environ.setdefault(key, value)
        super().capture()

    def _start(self) -> Any:
        if self.experiment is None:
            import comet_ml

            os.makedirs(self.directory, exist_ok=True)
            if self.key:  # a second archive of the same experiment; `comet upload` appends it
                self.experiment = comet_ml.ExistingOfflineExperiment(
                    experiment_key=self.key,
                    project_name=self.project,
                    offline_directory=self.directory,
                    **{k: v for k, v in _COLLECT_NOTHING.items() if k in _CONTINUE_ARGS},
                )
                return self.experiment
            self.experiment = comet_ml.OfflineExperiment(
                project_name=self.project, offline_directory=self.directory, **_COLLECT_NOTHING
            )
            self.key = self.experiment.get_key()
            self.experiment.set_name(self.trial_name or run_name(self.config))
            if self.trial_name:  # HF: trials are experiments of one search
                self.experiment.add_tag(run_name(self.config))
        return self.experiment

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
            self.key = None
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._start().log_parameters({**params, **(self.trial_params or {})})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._start().log_metrics({grouped_name(k): v for k, v in metrics.items()}, step=step)

    def finalize(self, status: str) -> None:
        if self.experiment is not None:
            self.experiment.end()
            self.experiment = None
