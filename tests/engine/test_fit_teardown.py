"""What fit() undoes when it leaves, normally or by an exception: `is_in_train` (HF's flag) goes back to
False, the precision plugin's process-wide settings are restored, and the background writer has written
every log record made before fit() returned or raised."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kiln import Callback, Logger, Trainer
from kiln.loggers import LOGGERS
from tests.helpers import TinyRegressor, base_config, regression_data


class _Fail(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, config, state, control, **kw):
        if state.global_step == self.at:
            raise RuntimeError("boom")


class _SeesTraining(Callback):
    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref
        self.seen: list[bool] = []

    def on_step_end(self, config, state, control, **kw):
        self.seen.append(self.trainer_ref[0].is_in_train)


def _trainer(tmp_path: Path, callbacks: list, **cfg: Any) -> Trainer:
    config = base_config(tmp_path, max_steps=4, per_device_train_batch_size=4, **cfg)
    return Trainer(TinyRegressor(), config, train_dataset=regression_data(32), callbacks=callbacks)


@pytest.mark.parametrize("fails", [False, True])
def test_is_in_train_is_true_during_fit_only(tmp_path: Path, fails: bool) -> None:
    ref: list = []
    seen = _SeesTraining(ref)
    trainer = _trainer(tmp_path, [seen, *([_Fail(2)] if fails else [])])
    ref.append(trainer)
    assert not trainer.is_in_train
    if fails:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit()
    else:
        trainer.fit()
    assert seen.seen and all(seen.seen) and trainer.is_in_train is False


@pytest.mark.parametrize("fails", [False, True])
def test_precision_settings_are_restored_when_fit_leaves(tmp_path: Path, fails: bool) -> None:
    trainer = _trainer(tmp_path, [_Fail(2)] if fails else [])
    calls: list[bool] = []
    teardown = trainer.precision.teardown
    trainer.precision.teardown = lambda: (calls.append(trainer.is_in_train), teardown())[1]  # type: ignore[method-assign]
    if fails:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit()
    else:
        trainer.fit()
    assert calls == [False]


RECORDS: list[int] = []


class _SlowLogger(Logger):
    """Takes its time on the writer thread, so that fit() leaving before the writer is done shows."""

    name = "slow_test_logger"

    def __init__(self, config: Any) -> None:
        super().__init__(config)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        time.sleep(0.3)
        RECORDS.append(step)


@pytest.fixture
def slow_logger():
    LOGGERS.add("slow_test_logger", _SlowLogger)
    RECORDS.clear()
    yield
    del LOGGERS._entries["slow_test_logger"]


def test_a_failing_fit_leaves_every_earlier_log_record_written(tmp_path: Path, slow_logger: None) -> None:
    trainer = _trainer(
        tmp_path, [_Fail(3)], report_to=["slow_test_logger"], log={"history": [], "disable_tqdm": True, "steps": 1}
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert RECORDS == [1, 2]  # step 3 failed in on_step_end, before its log event
