"""`task`: what the CLI trains, by import path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from kiln.config.schema.fields import opt


@dataclass
class TaskConfig:
    """What to train, by import path (used by the CLI; the Python API passes objects instead)."""

    model: Optional[str] = opt(None, "'package.module:callable' returning the model.")
    model_args: Dict[str, Any] = opt({}, "Keyword arguments for the model callable.")
    data: Optional[str] = opt(None, "'package.module:callable' returning a dict with train_dataset, eval_dataset, ...")
    data_args: Dict[str, Any] = opt({}, "Keyword arguments for the data callable.")
