"""A second train() on the same Trainer is a new run (HF): with model_init a fresh, re-seeded model; without
it the trained weights and optimizer continue under a new schedule. Checked against a fresh Trainer and
against transformers.Trainer called twice."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import read_write

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data


def _cfg(tmp_path, **kw):
    return base_config(
        tmp_path,
        **{
            "max_steps": 4,
            "per_device_train_batch_size": 8,
            "learning_rate": 1e-2,
            "log": {"history": [], "disable_tqdm": True, "steps": 1},
            "warmup_steps": 1,
            **kw,
        },
    )


def test_second_train_with_model_init_is_a_fresh_reseeded_run(tmp_path):
    data = regression_data(32)
    trainer = Trainer(None, _cfg(tmp_path, seed=1), model_init=lambda: TinyRegressor(dropout=0.2), train_dataset=data)
    trainer.fit()
    first = flat_params(trainer.model)
    history = list(trainer.state.log_history)
    out = trainer.train()
    assert out.global_step == 4 and trainer.state.global_step == 4  # not "resumed at step 4, 0 steps trained"
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(
        [h["loss"] for h in history if "loss" in h]
    )
    assert torch.equal(flat_params(trainer.model), first)

    with read_write(trainer.config):  # read-only once loaded: a changed seed applies to the next run, model init too
        trainer.config.seed = 7
    trainer.train()
    fresh = Trainer(
        None, _cfg(tmp_path / "fresh", seed=7), model_init=lambda: TinyRegressor(dropout=0.2), train_dataset=data
    )
    fresh.fit()
    assert torch.equal(flat_params(trainer.model), flat_params(fresh.model))
    assert not torch.equal(flat_params(trainer.model), first)


def test_second_train_without_model_init_matches_hf_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.engine.test_flow_vs_hf import Lin  # the same plain HF-contract model

    rows = [{"x": d["x"], "labels": d["y"]} for d in regression_data(16)]
    torch.manual_seed(0)
    model = Lin()
    theirs_model, ours_model = copy.deepcopy(model), copy.deepcopy(model)

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-2,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    hf = InOrder(model=theirs_model, args=args, train_dataset=rows)
    hf.train()
    hf.train()
    ours = Trainer(
        ours_model,
        _cfg(tmp_path, max_steps=3, per_device_train_batch_size=4),
        train_dataset=torch.utils.data.DataLoader(rows, batch_size=4),
    )
    ours.fit()
    ours.fit()
    assert ours.state.global_step == hf.state.global_step == 3

    def steps(history):  # flat: pytest >= 9.2's approx refuses nested sequences
        return [v for h in history if "loss" in h for v in (h["step"], h["learning_rate"], h["loss"])]

    assert steps(ours.state.log_history) == pytest.approx(steps(hf.state.log_history), rel=1e-5)
    assert torch.allclose(flat_params(ours_model), flat_params(theirs_model), atol=1e-6)


def test_a_second_train_keeps_the_users_own_scheduler(tmp_path):
    """HF drops only a schedule it built itself (`_created_lr_scheduler`); one passed in `optimizers=` stays, and
    goes on counting its steps across runs."""
    model = TinyRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = Trainer(model, _cfg(tmp_path), train_dataset=regression_data(32), optimizers=(opt, sched))
    trainer.fit()
    trainer.train()
    for _ in range(2):  # and a third run too
        assert trainer.lr_scheduler is sched and trainer.optimizer is opt
        trainer.train()
    assert sched.last_epoch == 16  # 4 runs of 4 steps on the one schedule
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**16)
