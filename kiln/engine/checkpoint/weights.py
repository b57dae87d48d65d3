"""Loading weights alone (no optimizer, no trainer state) into a Trainer's model, through its
strategy's CheckpointIO: for `kiln evaluate` / `kiln predict` and anything else that scores a
saved model. Works for a checkpoint folder of the strategy's format and for an exported model."""

from __future__ import annotations

from typing import Any


def load_weights_for_eval(trainer: Any, path: str) -> None:
    """Set the model up for evaluation (as the strategy places it), then load `path`'s weights."""
    model = trainer.setup_model()
    trainer.strategy.checkpoint_io().load_weights_only(path, model=model, module=trainer.model)
