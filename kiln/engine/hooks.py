"""What the loops use of the Trainer, written as Protocols so that the loops depend on this page
rather than on `trainer.py` (the Trainer is the top floor; nothing below imports it back).

These are Hugging Face's override points that the loops must call through the Trainer, so that a
subclass's override is honoured (`TrainerHooks` for the fit loop, `EvalHooks` for evaluate, predict and
the evaluation loop). Everything else the loops need (the Run, which holds the state, the control and
the checkpoint manager; the strategy, the precision plugin, the callbacks, the config) they receive as
their own typed arguments."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kiln.engine.evaluation.outputs import EvalLoopOutput


class TrainerHooks(Protocol):
    train_dataset: Any

    def create_optimizer(self) -> torch.optim.Optimizer: ...

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any: ...

    def get_train_dataloader(self) -> Iterable[Any]: ...

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor: ...

    def current_learning_rate(self) -> float: ...

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]: ...

    def _report_to_trial(self, metrics: dict[str, float]) -> None: ...

    def _save_checkpoint(self, metrics: dict[str, float] | None = None) -> str: ...

    def _load_best_model(self) -> None: ...


class EvalHooks(Protocol):
    """The Trainer's attributes and override points that evaluate, predict, the evaluation loop and the default
    prediction step read (attributes at call time: HF code may reassign `trainer.compute_metrics`)."""

    eval_dataset: Any
    compute_metrics: Any
    preprocess_logits_for_metrics: Any

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]: ...

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Iterable[Any]: ...

    def get_test_dataloader(self, test_dataset: Any) -> Iterable[Any]: ...

    def evaluation_loop(
        self,
        dataloader: Iterable[Any],
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput: ...

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]: ...

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any: ...

    def forward_inputs(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...


class Stateful(Protocol):
    """Something whose per-rank state goes into checkpoints (the fit loop's running sums)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
