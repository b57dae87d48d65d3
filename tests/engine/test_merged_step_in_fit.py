"""A fit steps HF's two param groups as one while their settings agree (kiln/optim/merged_step.py): one fused
kernel call a step instead of two, the weights of the grouped step exactly, HF's layout in the optimizer."""

from __future__ import annotations

import pytest
import torch

import kiln.engine.run as run_module
from kiln import Trainer
from tests.distributed import compile_toy as toy


def _fit(tmp_path, name: str, monkeypatch, merged: bool = True, **overrides):
    if not merged:
        monkeypatch.setattr(run_module, "step_equal_groups_as_one", lambda optimizer: False)
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model = toy.mlp()
    cfg = toy.kiln_config(
        str(tmp_path / name),
        batch=4,
        eval_batch=4,
        torch_compile_backend=None,
        eval_strategy="no",
        warmup_steps=2,
        max_grad_norm=0.5,
        optim="adamw_torch_fused",
        **overrides,
    )
    trainer = Trainer(model, cfg, train_dataset=toy.regression_data(18))
    trainer.fit()
    monkeypatch.undo()
    return trainer, model, len(calls)


def test_equal_groups_take_one_fused_call_a_step_with_the_grouped_weights(tmp_path, monkeypatch):
    trainer, model, calls = _fit(tmp_path, "merged", monkeypatch, weight_decay=0.0)
    _, grouped, grouped_calls = _fit(tmp_path, "grouped", monkeypatch, merged=False, weight_decay=0.0)
    steps = trainer.state.global_step
    assert steps == 6 and calls == steps and grouped_calls == 2 * steps
    assert getattr(trainer.optimizer.step, "_kiln_merged", False) and len(trainer.optimizer.param_groups) == 2
    torch.testing.assert_close(toy.flat(model.parameters()), toy.flat(grouped.parameters()), rtol=0, atol=0)


def test_groups_that_differ_in_decay_step_grouped(tmp_path, monkeypatch):
    trainer, _, calls = _fit(tmp_path, "decay", monkeypatch, weight_decay=0.01)
    assert calls == 2 * trainer.state.global_step


@pytest.mark.parametrize("setting", ["torch_compile_optimizer_step"])
def test_a_compiled_optimizer_step_is_left_as_compiled(tmp_path, monkeypatch, setting):
    model = toy.mlp()
    cfg = toy.kiln_config(
        str(tmp_path / "c"),
        batch=4,
        eval_batch=4,
        eval_strategy="no",
        optim="adamw_torch",
        max_steps=1,
        weight_decay=0.0,
    )
    cfg["train"] = {setting: True}
    toy.reset()
    trainer = Trainer(model, cfg, train_dataset=toy.regression_data(8))
    trainer.fit()
    assert getattr(trainer.optimizer.step, "_kiln_compiled", False)
    assert not getattr(trainer.optimizer.step, "_kiln_merged", False)


def test_a_strategy_whose_engine_owns_the_step_keeps_the_optimizers_own_step(tmp_path, monkeypatch):
    from kiln.strategies.capabilities import Capabilities
    from kiln.strategies.single import SingleDeviceStrategy

    # single stands in for DeepSpeed here
    monkeypatch.setattr(SingleDeviceStrategy, "capabilities", Capabilities(owns_optimizer_step=True))
    trainer, _, calls = _fit(tmp_path, "owned", monkeypatch, weight_decay=0.0)
    assert not getattr(trainer.optimizer.step, "_kiln_merged", False) and calls == 2 * trainer.state.global_step
