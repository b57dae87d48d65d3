"""ClearML, offline: one task per run, named `run_name` in project `log.project` (default `kiln`),
with the flattened config as its `kiln` hyperparameter section and every metric as a scalar with its
step: title `train`, `eval` or `test` and the rest of the name as series (HF's layout). ClearML keeps the
offline session under its cache folder (`~/.clearml/cache/offline/<task id>/` and a `.zip` of it, or
`CLEARML_CACHE_DIR`); `Task.import_offline_session(<zip>)` uploads it later.

Offline by construction (`Task.set_offline`), and ClearML's automatic capture is off: no framework
patching, no console, argv or resource capture, no repository or package detection (which also asks
ClearML's update server for a newer release)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require, run_name, setting

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

# Task.init binds every framework it knows unless told not to, one key each; `detect_repository`
# also starts the update check.
_FRAMEWORKS = (
    "detect_repository",
    "pytorch",
    "tensorboard",
    "tensorflow",
    "tfdefines",
    "matplotlib",
    "scikit",
    "joblib",
    "hydra",
    "xgboost",
    "catboost",
    "fastai",
    "lightgbm",
    "megengine",
    "jsonargparse",
    "gradio",
)


@LOGGERS.register("clearml")
class ClearMLLogger(Logger):
    name = "clearml"
    package = "clearml"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("clearml", "clearml", "report_to: clearml")
        self.project: str = setting(config, "project", "CLEARML_PROJECT", "kiln")
        self.task: Any | None = None

    def _start(self) -> Any:
        if self.task is None:
            from clearml import Task

            Task.set_offline(True)
            self.task = Task.init(
                project_name=self.project,
                task_name=self.trial_name or run_name(self.config),
                tags=[run_name(self.config)] if self.trial_name else None,
                reuse_last_task_id=False,
                auto_connect_frameworks={key: False for key in _FRAMEWORKS},
                auto_connect_arg_parser=False,
                auto_connect_streams=False,
                auto_resource_monitoring=False,
            )
            log.info("ClearML offline session: %s", self.task.get_offline_mode_folder())
        return self.task

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._start().connect(dict({**params, **(self.trial_params or {})}), name="kiln")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        logger = self._start().get_logger()
        for key, value in metrics.items():
            title, series = grouped_name(key).split("/", 1)
            logger.report_scalar(title=title, series=series, value=value, iteration=step)

    def finalize(self, status: str) -> None:
        if self.task is not None:
            self.task.close()  # writes the session's zip
            self.task = None
