"""The typed config tree (OmegaConf structured dataclasses), HF-name aliases and validation."""

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

__all__ = [
    "ConfigError", "load_config", "parse_dotlist", "valid_keys", "TrainingConfig", "TrainConfig", "DataConfig",
    "OptimConfig", "SchedulerConfig", "EvalConfig", "SaveConfig", "LogConfig", "StrategyConfig",
    "PrecisionConfig", "TaskConfig",
]
