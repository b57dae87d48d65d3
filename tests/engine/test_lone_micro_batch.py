"""`training_step` is called at one place (kiln/engine/loop/step.py), with HF's signature, inside the
out-of-memory guard and the strategy's synchronisation context; the micro-batch's place in its window is
`Run.micro_batch` while it runs, and None once the window is done."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kiln import Trainer
from kiln.engine.loop.loss_weights import MicroBatch
from kiln.engine.loop.step import _LONE
from kiln.strategies.interfaces import GraphBoundaries, OwnsMicroBatchWindow
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, base_config, regression_data, train_step_of


class Events:
    """StepEvents that record what the step asked of the fit loop."""

    def __init__(self, guarding: bool = False) -> None:
        self.guarding, self.calls = guarding, []

    @contextlib.contextmanager
    def guard(self, model: Any) -> Iterator[None]:
        self.calls.append("guard")
        yield

    def substep_end(self) -> None:
        self.calls.append("substep_end")

    def pre_optimizer_step(self) -> None:
        self.calls.append("pre_optimizer_step")

    def optimizer_step(self) -> None:
        self.calls.append("optimizer_step")


class Recording(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None, micro_batch=None):  # type: ignore[override]
        self.seen.append((micro_batch, num_items_in_batch, self.run.micro_batch))
        return super().training_step(model, inputs, num_items_in_batch, micro_batch)


def _step(tmp_path, trainer_class: type = Recording, **cfg: Any) -> tuple[Any, Any, list[dict[str, torch.Tensor]]]:
    trainer = trainer_class(
        TinyRegressor(),
        base_config(tmp_path, max_steps=1, per_device_train_batch_size=4, lr_scheduler_type="constant", **cfg),
        train_dataset=regression_data(16),
    )
    trainer.seen = []
    trainer.fit()  # sets the run up: module, optimizer, scheduler
    trainer.seen.clear()
    batches = [{"x": torch.randn(4, 8), "y": torch.randn(4)} for _ in range(2)]
    return trainer, train_step_of(trainer), batches


def test_a_lone_unweighted_micro_batch_is_the_shared_lone_micro_batch(tmp_path):
    trainer, step, batches = _step(tmp_path)
    assert not step.weighs
    events = Events()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    losses, result = step(batches[:1], trainer.run.wrapped, events)
    assert events.calls == ["guard", "pre_optimizer_step", "optimizer_step"]
    assert trainer.seen == [(None, None, _LONE)] and len(losses) == 1 and result.stepped
    assert result.grad_norm is not None  # clipped (max_grad_norm 1.0) by the strategy's optimizer step
    assert trainer.run.micro_batch is None  # cleared once the window is done
    assert not any(torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


def test_a_window_of_two_gives_each_micro_batch_its_place_and_the_window_item_count(tmp_path):
    trainer, step, batches = _step(tmp_path)
    events = Events()
    step.weighs = step.windows_need_weights(2)  # what the loop sets for windows of two micro-batches
    step(batches, trainer.run.wrapped, events)
    assert events.calls == ["guard", "substep_end", "pre_optimizer_step", "optimizer_step"]
    micros = [micro for _, _, micro in trainer.seen]
    assert [type(m) for m in micros] == [MicroBatch, MicroBatch] and [m.index for m in micros] == [0, 1]
    assert [m.boundary for m in micros] == [False, True] and micros[0].weights is micros[1].weights
    assert [float(m.weight) for m in micros] == [0.5, 0.5]  # 4 items each of 8
    assert [int(n) for _, n, _ in trainer.seen] == [8, 8]  # HF's num_items_in_batch: the window's items


def test_an_hf_signature_override_finds_the_micro_batch_in_the_run(tmp_path):
    class HFSignature(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
            self.seen.append(self.run.micro_batch)
            return super().training_step(model, inputs, num_items_in_batch)

    trainer, step, batches = _step(tmp_path, HFSignature)
    step(batches[:1], trainer.run.wrapped, Events())
    assert trainer.seen == [_LONE] and trainer.run.micro_batch is None


def test_a_strategy_that_cuts_graphs_is_told_after_a_lone_micro_batch(tmp_path, monkeypatch):
    trainer, step, batches = _step(tmp_path)
    cuts = []

    class Cutting(type(trainer.strategy), GraphBoundaries):  # type: ignore[misc]
        def on_micro_batch_end(self) -> None:
            cuts.append("micro_batch")

        def on_step_end(self) -> None:
            cuts.append("step")

    monkeypatch.setattr(trainer.strategy, "__class__", Cutting)
    step = train_step_of(trainer)
    step(batches[:1], trainer.run.wrapped, Events())
    assert cuts == ["micro_batch", "step"]


def _window_owner(trainer: Any, got: list) -> type:
    class Owner(type(trainer.strategy), OwnsMicroBatchWindow):  # type: ignore[misc]
        def run_window(self, model, window, weights):
            got.append((window, weights))
            return [torch.tensor(float(i)) for i in range(len(window))]

    return Owner


def test_a_window_owning_strategy_runs_the_whole_window_once_with_its_weights(tmp_path, monkeypatch):
    trainer, _, batches = _step(tmp_path, Trainer)
    trainer.seen = []
    got: list = []
    monkeypatch.setattr(trainer.strategy, "__class__", _window_owner(trainer, got))
    step = train_step_of(trainer)
    step.weighs = step.windows_need_weights(2)
    events = Events()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    losses, result = step(batches, trainer.run.wrapped, events)
    assert len(got) == 1 and got[0][0] is batches and [float(got[0][1].weight(i)) for i in (0, 1)] == [0.5, 0.5]
    assert [float(x) for x in losses] == [0.0, 1.0]  # what the strategy returned
    assert events.calls == ["guard", "substep_end", "pre_optimizer_step", "optimizer_step"]  # substeps still counted
    assert result.stepped and trainer.run.micro_batch is None
    # the strategy computed no gradient here, so the engine's optimizer step left the weights as they were
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


def test_a_window_owner_refuses_a_trainer_that_overrides_what_acts_per_micro_batch(tmp_path, monkeypatch):
    trainer, _, _ = _step(tmp_path)  # Recording overrides training_step
    monkeypatch.setattr(trainer.strategy, "__class__", _window_owner(trainer, []))
    with pytest.raises(
        KilnError, match=r"so Recording.training_step, which acts on one micro-batch, would never be called"
    ):
        train_step_of(trainer)
