"""The Trainer's per-run state lives in one Run: a second fit() is a new Run, the HF attributes read and
write it, `teardown` runs at a defined point, and hyperparameter search refuses what it cannot change."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, base_config, regression_data


def _trainer(tmp_path, **kw):
    cfg = base_config(tmp_path, max_steps=2, learning_rate=1e-2, **kw.pop("cfg", {}))
    return Trainer(config=cfg, train_dataset=regression_data(16), **kw)


def test_hf_attributes_are_the_runs(tmp_path):
    trainer = _trainer(tmp_path, model=TinyRegressor())
    run = trainer.run
    assert trainer.model is run.model and trainer.model_wrapped is run.model
    trainer.fit()
    assert trainer.optimizer is run.optimizer is not None and trainer.lr_scheduler is run.scheduler is not None
    assert trainer.model_wrapped is run.wrapped
    other = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    trainer.optimizer = other
    assert run.optimizer is other


def test_a_second_fit_is_a_new_run_with_model_init_and_keeps_the_weights_without(tmp_path):
    with_init = _trainer(tmp_path / "a", model_init=TinyRegressor)
    with_init.fit()
    first_run, first_model = with_init.run, with_init.model
    with_init.fit()
    assert with_init.run is not first_run and with_init.model is not first_model  # a fresh model (HF)
    assert with_init.run.optimizer is not first_run.optimizer and with_init.state.global_step == 2

    without = _trainer(tmp_path / "b", model=TinyRegressor())
    without.fit()
    run, optimizer = without.run, without.optimizer
    without.fit()
    assert without.run is not run and without.model is run.model and without.optimizer is optimizer
    assert without.state.global_step == 2  # the state starts over


def test_teardown_runs_on_leaving_the_with_block_once(tmp_path, monkeypatch):
    calls = []
    with _trainer(tmp_path, model=TinyRegressor()) as trainer:
        monkeypatch.setattr(trainer.strategy, "teardown", lambda: calls.append("strategy"))
        monkeypatch.setattr(trainer.precision, "teardown", lambda: calls.append("precision"))
        trainer.fit()
        calls.clear()  # fit restores the precision plugin's flags itself
    assert calls == ["precision", "strategy"]


def test_a_trial_may_not_change_the_strategy_or_precision(tmp_path):
    pytest.importorskip("optuna")
    trainer = _trainer(tmp_path, model_init=TinyRegressor)
    with pytest.raises(KilnError, match="cannot change the precision per trial"):
        trainer.hyperparameter_search(hp_space=lambda t: {"precision": "bf16"}, n_trials=1)
    assert trainer.config.output_dir == str(tmp_path / "out")  # the Trainer's own config is back


def test_the_run_owns_state_control_and_checkpoints_and_each_fit_gets_new_ones(tmp_path):
    trainer = _trainer(tmp_path, model=TinyRegressor())
    run = trainer.run
    assert trainer.state is run.state and trainer.control is run.control and trainer.checkpoints is run.checkpoints
    assert run.checkpoints.run is run
    trainer.fit()
    first = trainer.run
    trainer.fit()
    second = trainer.run
    assert second is not first and second.checkpoints.run is second
    for name in ("state", "control", "checkpoints"):
        assert getattr(second, name) is not getattr(first, name) and getattr(trainer, name) is getattr(second, name)
    assert first.state.global_step == second.state.global_step == 2  # the second fit's state started over


def test_assigning_a_model_starts_a_run_for_it_and_keeps_the_state(tmp_path):
    trainer = _trainer(tmp_path, model=TinyRegressor())
    trainer.fit()
    old, model = trainer.run, TinyRegressor()
    trainer.model = model
    new = trainer.run
    assert new is not old and new.model is model and new.optimizer is None and new.stage is None
    assert new.state is old.state and new.state.global_step == 2 and new.control is old.control  # HF keeps them
    assert new.checkpoints is not old.checkpoints and new.checkpoints.run is new
    assert trainer.callback_handler.objects["model"] is model
