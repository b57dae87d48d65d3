"""What the engine's parts (loops, checkpoints, evaluation, search, export) may use of the Trainer,
written as Protocols so that they depend on this page rather than on `trainer.py`: the Trainer is
the top floor and nothing below imports it back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy


class TrainerLike(Protocol):
    """The Trainer's public surface as the loops and mixins see it (see kiln.engine.trainer.Trainer)."""

    config: Any
    args: Any
    strategy: "Strategy"
    precision: "Precision"
    model: "nn.Module"
    model_wrapped: "nn.Module"
    optimizer: Optional["torch.optim.Optimizer"]
    lr_scheduler: Any
    state: Any
    control: Any
    callback_handler: Any
    checkpoints: Any
    train_dataset: Any
    eval_dataset: Any
    processing_class: Any
    is_in_train: bool

    def __getattr__(self, name: str) -> Any: ...  # the HF override points and the mixins' helpers


class Stateful(Protocol):
    """Something whose per-rank state goes into checkpoints (the fit loop's running sums)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
