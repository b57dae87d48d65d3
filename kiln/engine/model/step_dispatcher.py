"""Routes a TrainingModule's steps through `forward`, so wrappers that hook `forward` (DDP's
gradient sync, FSDP's all-gathers, DeepSpeed) see every training/validation/predict step."""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.engine.model.module import TrainingModule


class StepDispatcher(nn.Module):
    """`dispatcher(batch)` runs `training_step` in train mode and `validation_step` in eval mode;
    `dispatcher(batch, step="predict_step")` picks explicitly. It owns no parameters of its own:
    its single child is the user's module, registered as `module`."""

    def __init__(self, module: TrainingModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, step: str | None = None) -> Any:
        name = step or ("training_step" if self.training else "validation_step")
        return getattr(self.module, name)(batch)
