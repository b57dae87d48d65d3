"""`train.max_nonfinite_steps` is honoured whatever the logging interval (issue 52 item 9): the run stops
after exactly that many consecutive nan/inf steps, where before it ran on until the next log or save step
read the losses (30 nan steps with a limit of 3 and logging_steps 50). The guard reads the losses itself
at the first step where the limit could be reached, so a run whose losses stay finite reads them once
every `max_nonfinite_steps` steps at most (tests/engine/test_host_sync.py counts the reads)."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.engine.loop.loss_reads import NonFiniteGuard, NonFiniteLossError
from tests.engine.test_nonfinite_loss import NanAt, _Ranks
from tests.helpers import base_config, regression_data


def steps_run(tmp_path, limit: int, logging_steps: int, first_nan: int, accumulation: int = 1, **cfg) -> int:
    """The optimizer steps a run with nan losses from step `first_nan` on trains before it stops."""
    calls = range((first_nan - 1) * accumulation + 1, 10**6)  # training_step calls with a nan loss
    trainer = Trainer(
        NanAt(calls),
        base_config(
            tmp_path,
            max_steps=60,
            per_device_train_batch_size=2,
            logging_steps=logging_steps,
            gradient_accumulation_steps=accumulation,
            train={"max_nonfinite_steps": limit},
            **cfg,
        ),
        train_dataset=regression_data(64),
    )
    with pytest.raises(NonFiniteLossError, match=f"nan/inf for {limit} consecutive steps"):
        trainer.fit()
    return trainer.state.global_step


@pytest.mark.parametrize("logging_steps", [1, 2, 50, 500])
@pytest.mark.parametrize("first_nan", [1, 2, 7])
def test_exactly_the_limit_of_nan_steps_run_at_any_logging_interval(tmp_path, logging_steps, first_nan):
    assert steps_run(tmp_path, 3, logging_steps, first_nan) - first_nan + 1 == 3


@pytest.mark.parametrize("limit, logging_steps, first_nan", [(1, 50, 5), (4, 3, 2), (10, 500, 1), (10, 7, 6)])
def test_other_limits(tmp_path, limit, logging_steps, first_nan):
    assert steps_run(tmp_path, limit, logging_steps, first_nan) - first_nan + 1 == limit


def test_with_accumulation_a_step_counts_once(tmp_path):
    assert steps_run(tmp_path, 3, 50, 2, accumulation=2) == 4


def test_a_save_step_between_does_not_shift_the_stop(tmp_path):
    assert steps_run(tmp_path, 5, 50, 3, save={"strategy": "steps", "steps": 4}) == 7
    assert not (tmp_path / "out" / "checkpoint-8").exists()


def test_the_reads_follow_the_run_in_progress():
    """The next read is where the run of nan steps seen so far would reach the limit."""
    guard = NonFiniteGuard(5)
    guard.schedule(0, 0)
    assert guard.next_check == 5
    for step in (4, 5):
        guard.step(step, [float("nan")])
    guard.check(_Ranks(1), 5)
    assert guard.next_check == 8  # 2 nan steps so far: 3 more could end at step 8
    guard.all_finite()
    guard.check(_Ranks(1), 8)
    assert guard.next_check == 13
    assert NonFiniteGuard(0).next_check == float("inf")
    off = NonFiniteGuard(0)
    off.check(_Ranks(1), 3)
    assert off.next_check == float("inf")  # switched off: never read for the guard


def test_every_rank_reads_at_the_same_step():
    """The schedule follows the ranks' longest run in progress, so all ranks meet in the next collective."""
    guard = NonFiniteGuard(5)
    guard.all_finite()
    guard.check(_Ranks(2, others=3), 10)  # this rank: finite; another rank: 3 nan steps ending at step 10
    assert guard.next_check == 12


def test_a_resumed_run_reads_where_the_uninterrupted_one_would(tmp_path):
    """The nan steps just before a checkpoint are saved with it, so the resumed run stops at the same step."""
    cfg = {
        "max_steps": 20,
        "per_device_train_batch_size": 2,
        "logging_steps": 50,
        "train": {"max_nonfinite_steps": 4},
        "save": {"strategy": "steps", "steps": 6},
    }
    straight = Trainer(NanAt(range(5, 100)), base_config(tmp_path / "a", **cfg), train_dataset=regression_data(64))
    with pytest.raises(NonFiniteLossError):
        straight.fit()
    assert straight.state.global_step == 8  # nan from step 5: 4 of them end at step 8
    first = Trainer(
        NanAt(range(5, 100)), base_config(tmp_path / "b", **{**cfg, "max_steps": 6}), train_dataset=regression_data(64)
    )
    first.fit()  # saves checkpoint-6 after 2 nan steps
    again = NanAt(range(1, 100))  # the resumed steps are nan from the start
    resumed = Trainer(again, base_config(tmp_path / "b", **cfg), train_dataset=regression_data(64))
    with pytest.raises(NonFiniteLossError, match="for 4 consecutive steps"):
        resumed.fit(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-6"))
    assert resumed.state.global_step == 8
    saved = torch.load(tmp_path / "b" / "out" / "checkpoint-6" / "loop_state_0.pt", weights_only=True)
    assert saved["loop"]["nonfinite_streak"] == 2
