"""kiln: a PyTorch training framework with Hugging Face Trainer semantics on a Lightning-style
architecture. Names are imported lazily so that `import kiln` stays cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "kiln.engine.trainer",
    "TrainOutput": "kiln.engine.loops",
    "TrainingModule": "kiln.engine.module",
    "TrainingConfig": "kiln.config.schema",
    "load_config": "kiln.config.load",
    "ConfigError": "kiln.config.load",
    "Callback": "kiln.engine.callbacks",
    "TrainerState": "kiln.engine.state",
    "TrainerControl": "kiln.engine.state",
    "EvalPrediction": "kiln.engine.outputs",
    "PredictionOutput": "kiln.engine.outputs",
    "EarlyStoppingCallback": "kiln.engine.early_stopping",
    "BestRun": "kiln.engine.hp_search",
    "Strategy": "kiln.strategies.base",
    "Precision": "kiln.precision.base",
    "Logger": "kiln.loggers.base",
    "set_seed": "kiln.engine.seed",
    "CheckpointError": "kiln.engine.errors",
    "KilnError": "kiln.engine.errors",
    "default_data_collator": "kiln.engine.data",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kiln.config.load import ConfigError, load_config
    from kiln.config.schema import TrainingConfig
    from kiln.engine.callbacks import Callback
    from kiln.engine.data import default_data_collator
    from kiln.engine.early_stopping import EarlyStoppingCallback
    from kiln.engine.errors import CheckpointError, KilnError
    from kiln.engine.loops import TrainOutput
    from kiln.engine.module import TrainingModule
    from kiln.engine.outputs import EvalPrediction, PredictionOutput
    from kiln.engine.seed import set_seed
    from kiln.engine.state import TrainerControl, TrainerState
    from kiln.engine.trainer import Trainer
    from kiln.loggers.base import Logger
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
