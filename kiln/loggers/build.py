"""Which loggers a config asks for, and building them: the Logger objects are built here, on the
loggers' floor; the callback that connects them to the loop is kiln.engine.callbacks.loggers."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from numbers import Number
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS, TRACKERS
from kiln.loggers.base import Logger, MissingPackageError, setting
from kiln.loggers.writer import flush_writes

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: the environment variables HF's integrations read for "upload the model": per tracker
_ARTIFACT_ENV = {"mlflow": "HF_MLFLOW_LOG_ARTIFACTS", "wandb": "WANDB_LOG_MODEL"}


def history_names(config: DictConfig) -> list[str]:
    """The local history files: `log.history` when set; unset, csv and jsonl unless `report_to` is
    none (HF's default), where HF writes nothing under output_dir/runs and neither does kiln."""
    if config.log.history is not None:
        return [str(name) for name in config.log.history]
    reported = [str(name).lower() for name in config.log.report_to]
    return [] if not reported or reported == ["none"] else ["csv", "jsonl"]


def logger_names(config: DictConfig) -> list[str]:
    """`report_to` (with HF's `all` = every installed tracker, `none` = none) plus the local history
    files (history_names), without duplicates, in order."""
    names: list[str] = []
    for name in [*config.log.report_to, *history_names(config)]:
        name = str(name).lower()
        if name == "none":
            continue
        if name == "all":
            names += [t for t in TRACKERS if importlib.util.find_spec(t) is not None]
        else:
            names.append(name)
    return list(dict.fromkeys(names))


def build_loggers(config: DictConfig, *, is_global_zero: bool = True) -> list[Logger]:
    """The loggers the config names; `[]` off global rank 0. Every name is checked and every package
    found before anything is built, and building opens no run, so a bad `report_to` fails in one
    sentence before training and leaves nothing behind."""
    if not is_global_zero:
        return []
    flush_writes()  # loggers read the history files an earlier run in this process may still be writing
    names = logger_names(config)
    for name in names:
        LOGGERS.check(name)
    classes: list[Any] = [LOGGERS.get(name) for name in names]
    loggers: list[Logger] = []
    missing: list[tuple[str, MissingPackageError]] = []
    for cls in classes:
        try:
            loggers.append(cls(config))
        except MissingPackageError as err:
            missing.append((cls.name, err))
    if len(missing) == 1:
        raise missing[0][1]
    if missing:
        names = [name for name, _ in missing]
        extras = list(dict.fromkeys(err.extra for _, err in missing))
        raise MissingPackageError(
            f"report_to: {', '.join(names)} need packages that are not installed: pip install kiln[{','.join(extras)}]"
        )
    return loggers


def artifact_mode(config: DictConfig, logger: str) -> str:
    """ "false", "end" (the best or last checkpoint when training ends) or "checkpoint" (every saved
    checkpoint): `log.log_artifacts`, else HF's variable for that tracker."""
    value = setting(config, "log_artifacts", _ARTIFACT_ENV.get(logger), "false")
    value = str(value).strip().lower()
    if value in ("1", "true", "yes"):  # HF_MLFLOW_LOG_ARTIFACTS=1 means every checkpoint; WANDB_LOG_MODEL=true the end
        return "checkpoint" if logger == "mlflow" else "end"
    return value if value in ("end", "checkpoint") else "false"


def scalar_metrics(logs: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a log dict (numbers, numpy scalars, one-element tensors); bools, strings
    and containers are left out."""
    out: dict[str, float] = {}
    for key, value in logs.items():
        if type(value) is float or type(value) is int:  # nearly every entry: skips the slower checks below
            out[key] = value
            continue
        if isinstance(value, (bool, str, bytes)):
            continue
        if isinstance(value, Number):
            out[key] = value  # type: ignore[assignment]
        elif hasattr(value, "item"):
            size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
            if size == 1:
                out[key] = value.item()
    return out
