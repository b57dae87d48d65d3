"""HF's Trainer attributes (`state`, `control`, `model_wrapped`, `optimizer`, `lr_scheduler`,
`label_names`, `_train_batch_size`, `_gen_kwargs`, `_eval_dataloaders`), kiln's per-fit ones (`checkpoints`, `log_to_loggers_only`) and introspection (`get_learning_rates`, `get_optimizer_group`,
`get_num_trainable_parameters`), read from and written to the Trainer's current `Run`: one place
holds each piece of run state, and HF code that reads or assigns these attributes keeps working."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.engine.loop.loss_weights import MicroBatch

if TYPE_CHECKING:
    from kiln.engine.callbacks.state import TrainerControl, TrainerState
    from kiln.engine.checkpoint.manager import CheckpointManager
    from kiln.engine.run import Run


class RunAttributes:
    """The attributes over `run`, the one thing this base class reads (the Trainer sets it; `model`, whose
    assignment starts a new run, is the Trainer's own property)."""

    run: Run

    # -- HF's attributes, over the run ------------------------------------------------------
    @property
    def state(self) -> TrainerState:
        return self.run.state

    @state.setter
    def state(self, state: TrainerState) -> None:
        self.run.state = state

    @property
    def control(self) -> TrainerControl:
        """The run's flags: what the last callback event returned (the Run is the control's one owner)."""
        return self.run.control

    @control.setter
    def control(self, control: TrainerControl) -> None:
        self.run.control = control

    @property
    def checkpoints(self) -> CheckpointManager:
        return self.run.checkpoints

    @property
    def log_to_loggers_only(self) -> dict[str, float] | None:
        """Throughput figures the next `log()` sends to the loggers only (the fit loop sets them)."""
        return self.run.log_to_loggers_only

    @log_to_loggers_only.setter
    def log_to_loggers_only(self, figures: dict[str, float] | None) -> None:
        self.run.log_to_loggers_only = figures

    @property
    def _trial(self) -> Any:
        """The hyperparameter-search trial (Optuna's, or a Ray trial) this Trainer trains; None outside a search."""
        return self.run.trial.trial if self.run.trial is not None else None

    @property
    def model_wrapped(self) -> nn.Module:
        """The model as the strategy set it up (DDP, FSDP, DeepSpeed's engine...), as in HF."""
        assert self.run.wrapped is not None
        return self.run.wrapped

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.run.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.run.optimizer = optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.run.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self.run.scheduler = scheduler

    @property
    def _gen_kwargs(self) -> dict[str, Any]:
        """`model.generate`'s kwargs of the evaluate/predict call in flight (HF's Seq2SeqTrainer keeps them here)."""
        return self.run.gen_kwargs

    @_gen_kwargs.setter
    def _gen_kwargs(self, gen_kwargs: dict[str, Any]) -> None:
        self.run.gen_kwargs = gen_kwargs

    @property
    def _eval_dataloaders(self) -> dict[str, Any]:
        """HF's name for the run's reused eval loaders (`dataloader_persistent_workers`)."""
        return self.run.eval_loaders

    @property
    def label_names(self) -> list[str]:
        return self.run.facts.label_names

    @property
    def _train_batch_size(self) -> int:
        """HF's name for the live per-device batch size (auto_find_batch_size may lower it)."""
        return self.run.micro_batch_size

    @property
    def current_micro_batch(self) -> MicroBatch | None:
        """The micro-batch an override with HF's `training_step` signature is running (see loop/step.py)."""
        return self.run.micro_batch

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.run.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each optimizer param group (HF); an error before the optimizer exists."""
        return [group["lr"] for group in self._require_optimizer().param_groups]

    def get_optimizer_group(self, param: str | nn.Parameter | None = None) -> Any:
        """HF's API: the param group holding `param` (a Parameter or its name), else every group's params."""
        groups = self._require_optimizer().param_groups
        if isinstance(param, str):
            param = dict(self.run.model.named_parameters()).get(param)
        if param is not None:
            for group in groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in groups]

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ValueError(
                "Trainer optimizer is None, please make sure you have setup the optimizer before "
                "(call create_optimizer() or train() first)."
            )
        return self.optimizer
