"""The typed config tree (OmegaConf structured dataclasses), HF-name aliases and validation.

Names are resolved lazily: importing a submodule such as `kiln.config.schema` (plain dataclasses) must
not pull in omegaconf, which costs ~0.2 s and is only needed where a config is built or merged."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LOAD = ("ConfigError", "load_config", "parse_dotlist", "valid_keys")
#: each config class -> the schema module that defines it
_SCHEMA = {
    "TrainingConfig": "kiln.config.schema",
    "TrainConfig": "kiln.config.schema.train",
    "DataConfig": "kiln.config.schema.data",
    "OptimConfig": "kiln.config.schema.optim",
    "SchedulerConfig": "kiln.config.schema.optim",
    "EvalConfig": "kiln.config.schema.evaluation",
    "SaveConfig": "kiln.config.schema.save",
    "LogConfig": "kiln.config.schema.log",
    "StrategyConfig": "kiln.config.schema.strategy",
    "PrecisionConfig": "kiln.config.schema.precision",
    "TaskConfig": "kiln.config.schema.task",
}
__all__ = [*_LOAD, *_SCHEMA]

if TYPE_CHECKING:
    from kiln.config.load import ConfigError, load_config, parse_dotlist, valid_keys
    from kiln.config.schema import TrainingConfig
    from kiln.config.schema.data import DataConfig
    from kiln.config.schema.evaluation import EvalConfig
    from kiln.config.schema.log import LogConfig
    from kiln.config.schema.optim import OptimConfig, SchedulerConfig
    from kiln.config.schema.precision import PrecisionConfig
    from kiln.config.schema.save import SaveConfig
    from kiln.config.schema.strategy import StrategyConfig
    from kiln.config.schema.task import TaskConfig
    from kiln.config.schema.train import TrainConfig


def __getattr__(name: str) -> Any:
    if name in _LOAD:
        module = "kiln.config.load"
    elif name in _SCHEMA:
        module = _SCHEMA[name]
    else:
        raise AttributeError(f"module 'kiln.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
