"""The Trainer's set-up half: the pieces its constructor receives (a config or HF `args`, objects
travelling beside a dict config), what the strategy sets up (module for evaluation; module,
optimizer and scheduler together for training) and the loss weights of each accumulation window."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from kiln.engine.loop.loss_weights import WindowWeights
from kiln.engine.model.step_dispatcher import StepDispatcher
from kiln.optim.schedulers import scheduler_needs_metrics
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.protocols import TrainerLike


class SetupMixin:
    """Mixed into Trainer; `self` is the Trainer."""

    def _module_to_set_up(self: "TrainerLike") -> nn.Module:
        """The module the strategy sets up: a TrainingModule behind its StepDispatcher (so wrappers
        that hook forward see every step), with gradient checkpointing enabled first."""
        if self._forward_module is None:
            if self.config.train.gradient_checkpointing and hasattr(self.model, "gradient_checkpointing_enable"):
                kwargs = self.config.train.gradient_checkpointing_kwargs or {}
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs))
            self._forward_module = StepDispatcher(self.model) if self._training_module else self.model
        return self._forward_module

    def setup_model(self: "TrainerLike") -> nn.Module:
        """The module set up by the strategy for evaluation (before training: without an optimizer)."""
        if self._setup_stage is None:
            self.model_wrapped = self.strategy.setup(self._module_to_set_up()).model
            self._setup_stage = "eval"
        return self.model_wrapped

    def setup_training(self: "TrainerLike", max_steps: Optional[int] = None) -> None:
        """Module, optimizer and (given the step count) scheduler, set up by the strategy in one call."""
        if self._setup_stage != "train":
            schedule = (lambda optimizer: self.create_scheduler(max_steps, optimizer)) if max_steps is not None else None
            setup = self.strategy.setup(self._module_to_set_up(), lambda _model: self.create_optimizer(), schedule,
                                        max_steps=max_steps)
            self.model_wrapped, self.optimizer = setup.model, setup.optimizer
            if setup.scheduler is not None:
                self.lr_scheduler = setup.scheduler
            self._setup_stage = "train"
        elif max_steps is not None and self.lr_scheduler is None:  # set up earlier without a step count (auto batch size)
            self.create_scheduler(max_steps, self.optimizer)
        elif max_steps is not None:
            self.scheduler_needs_metrics = scheduler_needs_metrics(self.lr_scheduler)
        if max_steps is not None:
            self.precision.setup()

    # -- one micro-batch (HF override points) -----------------------------------------------
    def loss_weights(self: "TrainerLike", window: list[Any]) -> Optional[WindowWeights]:
        """Per-micro-batch loss weights for this window (None: one micro-batch on one shard, whose
        mean loss needs no weighting). See kiln.engine.loop.loss_weights."""
        s = self.strategy
        # static shapes: a short window is weighed like a full one whose missing micro-batches count zero
        # items (zeros uploaded like the other counts, so its first micro-batch replays a full window's graph)
        slots = self.config.train.gradient_accumulation_steps if s.static_shapes else len(window)
        if slots == 1 and not self.windows_need_weights(1):
            return None
        raw = [self._count_items(b) for b in window] + [0] * (slots - len(window))
        if any(isinstance(c, torch.Tensor) for c in raw):
            counts = [torch.as_tensor(c, device=s.root_device) for c in raw]
        else:  # one upload for the window (XLA would make a 0-dim 0 or 1 a graph constant, not an input)
            counts = list(torch.tensor(raw, device=s.root_device).unbind())
        return WindowWeights.for_window(counts, data_shards=s.data_shards, grad_divisor=s.grad_divisor,
                                        global_mean=self._global_mean, model_divides=self._model_divides(window),
                                        reduce_async=s.reduce_async)

    def windows_need_weights(self: "TrainerLike", micro_batches: int) -> bool:
        """Whether `loss_weights` can return weights for windows of up to `micro_batches` micro-batches
        (False: a lone micro-batch on one shard, or shards that average their own means, and a model
        that takes no item count). The loop asks once per fit instead of building a window's weights."""
        s = self.strategy
        return micro_batches > 1 or (s.data_shards > 1 and self._global_mean) or self._accepts_num_items

    def _model_divides(self: "TrainerLike", window: list[Any]) -> bool:
        """HF passes num_items_in_batch (and the model divides by it) only when the batch has `labels`."""
        return self._accepts_num_items and isinstance(window[0], Mapping) and "labels" in window[0]


def _config_or_args(config: Any, args: Any) -> Any:
    """`args=` is HF's name for the settings (a TrainingArguments, or anything `config=` takes)."""
    if args is None:
        return config
    if config is not None:
        raise KilnError("Trainer got both `config=` and `args=`; pass the settings once (args= is HF's name for config=).")
    return args


def _pop_objects(config: Any, strategy: Any, precision: Any, overrides: Iterable[str]) -> tuple[Any, Any, Any, list[str]]:
    """Allow `{"strategy": MyStrategy(), ...}` in a dict config: objects travel beside the config.
    Names stay in the config, numbers and booleans too (`{"precision": 16}`: the config reads them);
    a name or number given as the `precision=` keyword becomes the config's (`precision="bf16"`, `16`)."""
    overrides = list(overrides)
    if isinstance(precision, (str, int, float)) and not isinstance(precision, bool):
        overrides.append(f"precision={precision}")
        precision = None
    if isinstance(config, Mapping):
        config = dict(config)
        for key in ("strategy", "precision"):
            value = config.get(key)
            if value is not None and not isinstance(value, (str, Mapping, int, float)):
                config.pop(key)
                if key == "strategy":
                    strategy = strategy or value
                else:
                    precision = precision or value
    return config, strategy, precision, overrides
