"""A loss that is nan/inf from the first step: kiln warns at once, logs nan (never the filter's 0.0),
stops after train.max_nonfinite_steps consecutive such steps before saving them, and says so when
it writes weights after one (issue 34, item 11)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kiln import Trainer
from kiln.engine.loop.loss_reads import NonFiniteGuard, NonFiniteLossError
from tests.helpers import TinyRegressor, base_config, regression_data


class NanAt(TinyRegressor):
    """Its loss is nan on the given (1-based) calls of training_step; every call when none are given."""

    def __init__(self, calls: range | None = None) -> None:
        super().__init__()
        self.calls, self.seen = calls, 0

    def training_step(self, batch):
        self.seen += 1
        loss = super().training_step(batch)
        return loss * float("nan") if self.calls is None or self.seen in self.calls else loss


def _trainer(tmp_path, calls: range | None = None, **overrides) -> Trainer:
    cfg = base_config(tmp_path, **{"max_steps": 20, "per_device_train_batch_size": 2, "logging_steps": 1, **overrides})
    return Trainer(NanAt(calls), cfg, train_dataset=regression_data(32))


def test_nan_from_the_first_step_stops_before_saving(tmp_path, caplog) -> None:
    trainer = _trainer(tmp_path, save={"strategy": "steps", "steps": 10})
    with caplog.at_level(logging.WARNING, logger="kiln"):
        with pytest.raises(
            NonFiniteLossError, match=r"nan/inf for 10 consecutive steps \(train.max_nonfinite_steps=10\)"
        ):
            trainer.fit()
    assert "The training loss is nan at step 1" in caplog.text
    assert trainer.state.global_step == 10
    assert not (tmp_path / "out" / "checkpoint-10").exists()  # stopped at the read before the save
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 9 and all(math.isnan(v) for v in losses), losses  # not the filter's 0.0


def test_a_checkpoint_after_nan_steps_says_so(tmp_path, caplog) -> None:
    trainer = _trainer(tmp_path, save={"strategy": "steps", "steps": 4}, max_steps=6)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        result = trainer.fit()
    assert "The checkpoint of step 4 comes after 4 consecutive step(s) with a nan/inf training loss" in caplog.text
    assert "The model this fit leaves (and any save_model after it) comes after 6 consecutive" in caplog.text
    assert math.isnan(result.training_loss)


def test_zero_never_stops(tmp_path) -> None:
    result = _trainer(tmp_path, train={"max_nonfinite_steps": 0}).fit()
    assert result.global_step == 20 and math.isnan(result.training_loss)


def test_checked_at_the_end_when_no_log_step_reads_the_losses(tmp_path) -> None:
    with pytest.raises(NonFiniteLossError):
        _trainer(tmp_path, logging_steps=1000).fit()


def test_a_few_nan_steps_are_filtered_as_before(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln"):
        result = _trainer(tmp_path, range(3, 6), max_steps=8).fit()  # steps 3-5 are nan: 3 < 10
    assert "The training loss is nan at step 3" in caplog.text
    assert math.isfinite(result.training_loss)


class _Ranks:
    """A strategy stand-in: `world` processes, and the max the other ranks report."""

    def __init__(self, world: int, others: int = 0) -> None:
        self.world_size, self.others, self.root_device, self.reduced = world, others, torch.device("cpu"), 0

    def reduce(self, tensor, op):
        assert op == "max"
        self.reduced += 1
        return torch.maximum(tensor, torch.tensor(self.others))


NAN = float("nan")


def test_a_finite_step_restarts_the_count() -> None:
    guard = NonFiniteGuard(10)
    for step in range(1, 6):
        guard.step(step, [NAN])
    guard.step(6, [1.0])
    for step in range(7, 16):
        guard.step(step, [2.0, NAN])  # one nan micro-batch makes the step non-finite
    guard.check(_Ranks(1), 15)  # 5, then 9: never 10 in a row
    guard.step(16, [NAN])
    with pytest.raises(NonFiniteLossError, match="for 10 consecutive steps"):
        guard.check(_Ranks(1), 16)


def test_every_rank_stops_together_and_one_process_needs_no_collective() -> None:
    alone = _Ranks(1)
    NonFiniteGuard(3).check(alone, 0)
    assert alone.reduced == 0
    with pytest.raises(NonFiniteLossError, match="for 4 consecutive steps"):
        NonFiniteGuard(3).check(_Ranks(2, others=4), 0)  # this rank saw only finite losses, another saw 4 nan steps


def test_resumed_sums_count_as_finite() -> None:
    guard = NonFiniteGuard(10)
    guard.resumed()
    assert guard.window_finite and guard.any_finite
