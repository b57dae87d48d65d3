"""The typed config tree (OmegaConf structured dataclasses), HF-name aliases and validation.

Names are resolved lazily: importing a submodule such as `kiln.config.schema` (plain dataclasses) must
not pull in omegaconf, which costs ~0.2 s and is only needed where a config is built or merged."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LOAD = ("ConfigError", "load_config", "parse_dotlist", "valid_keys")
_SCHEMA = (
    "TrainingConfig",
    "TrainConfig",
    "DataConfig",
    "OptimConfig",
    "SchedulerConfig",
    "EvalConfig",
    "SaveConfig",
    "LogConfig",
    "StrategyConfig",
    "PrecisionConfig",
    "TaskConfig",
)
__all__ = [*_LOAD, *_SCHEMA]

if TYPE_CHECKING:
    from kiln.config.load import ConfigError, load_config, parse_dotlist, valid_keys
    from kiln.config.schema import (
        DataConfig,
        EvalConfig,
        LogConfig,
        OptimConfig,
        PrecisionConfig,
        SaveConfig,
        SchedulerConfig,
        StrategyConfig,
        TaskConfig,
        TrainConfig,
        TrainingConfig,
    )


def __getattr__(name: str) -> Any:
    if name in _LOAD:
        module = "kiln.config.load"
    elif name in _SCHEMA:
        module = "kiln.config.schema"
    else:
        raise AttributeError(f"module 'kiln.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
