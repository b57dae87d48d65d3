"""What the fit loop uses of the Trainer, written as a Protocol so that the loop depends on this page
rather than on `trainer.py` (the Trainer is the top floor; nothing below imports it back).

These are Hugging Face's override points that the loop must call through the Trainer, so that a
subclass's override is honoured. Everything else the loop needs (the Run, which holds the state,
the control and the checkpoint manager; the strategy, the precision plugin, the callbacks, the
config) it receives as its own typed arguments."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


class TrainerHooks(Protocol):
    train_dataset: Any

    def create_optimizer(self) -> torch.optim.Optimizer: ...

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any: ...

    def get_train_dataloader(self) -> Iterable[Any]: ...

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor: ...

    def current_learning_rate(self) -> float: ...

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...

    def evaluate_during_training(self, on_start: bool = False) -> dict[str, float]: ...

    def _save_checkpoint(self, metrics: dict[str, float] | None = None) -> str: ...

    def _load_best_model(self) -> None: ...


class Stateful(Protocol):
    """Something whose per-rank state goes into checkpoints (the fit loop's running sums)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
