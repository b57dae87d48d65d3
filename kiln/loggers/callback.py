"""Connects the Logger objects to the loop: a callback built on global rank 0 only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks import Callback
from kiln.loggers import LOGGERS, TRACKERS
from kiln.loggers.base import Logger, flatten

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.state import TrainerControl, TrainerState


def logger_names(config: "DictConfig") -> list[str]:
    """`report_to` (with `all` / `none`) plus the local history files, without duplicates."""
    import importlib.util

    names: list[str] = []
    for name in list(config.log.report_to) + list(config.log.history):
        if name == "none":
            continue
        if name == "all":
            names += [t for t in TRACKERS if importlib.util.find_spec(t if t != "tensorboard" else "tensorboard") is not None]
        else:
            names.append(name)
    return list(dict.fromkeys(names))


def build_loggers(config: "DictConfig") -> list[Logger]:
    return [LOGGERS.get(name)(config) for name in logger_names(config)]


class LoggerCallback(Callback):
    def __init__(self, config: "DictConfig", loggers: list[Logger]) -> None:
        self.loggers = loggers
        self._params_logged = False

    def on_train_begin(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        if self._params_logged:
            return
        from omegaconf import OmegaConf

        params = flatten(OmegaConf.to_container(config, resolve=True))  # type: ignore[arg-type]
        for logger in self.loggers:
            logger.log_hyperparams(params)
        self._params_logged = True

    def on_log(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        logs = kw.get("logs") or {}
        metrics = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_metrics(metrics, state.global_step)

    def on_train_end(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        for logger in self.loggers:
            logger.finalize("success")
