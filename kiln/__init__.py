"""kiln: a PyTorch training framework with Hugging Face Trainer semantics on a Lightning-style
architecture. Names are imported lazily so that `import kiln` stays cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "kiln.engine.trainer",
    "TrainOutput": "kiln.engine.loop.fit",
    "TrainingModule": "kiln.engine.model.module",
    "TrainingConfig": "kiln.config.schema",
    "load_config": "kiln.config.load",
    "ConfigError": "kiln.config.load",
    "Callback": "kiln.engine.callbacks.base",
    "TrainerState": "kiln.engine.callbacks.state",
    "TrainerControl": "kiln.engine.callbacks.state",
    "EvalPrediction": "kiln.engine.evaluation.outputs",
    "PredictionOutput": "kiln.engine.evaluation.outputs",
    "EarlyStoppingCallback": "kiln.engine.callbacks.early_stopping",
    "BestRun": "kiln.engine.hp_search",
    "Strategy": "kiln.strategies.base",
    "Precision": "kiln.precision.base",
    "Logger": "kiln.loggers.base",
    "set_seed": "kiln.engine.seed",
    "CheckpointError": "kiln.utils.errors",
    "KilnError": "kiln.utils.errors",
    "default_data_collator": "kiln.engine.data.collator",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kiln.config.load import ConfigError, load_config
    from kiln.config.schema import TrainingConfig
    from kiln.engine.callbacks.base import Callback
    from kiln.engine.callbacks.early_stopping import EarlyStoppingCallback
    from kiln.engine.callbacks.state import TrainerControl, TrainerState
    from kiln.engine.data.collator import default_data_collator
    from kiln.engine.evaluation.outputs import EvalPrediction, PredictionOutput
    from kiln.engine.loop.fit import TrainOutput
    from kiln.engine.model.module import TrainingModule
    from kiln.engine.seed import set_seed
    from kiln.engine.trainer import Trainer
    from kiln.loggers.base import Logger
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy
    from kiln.utils.errors import CheckpointError, KilnError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
