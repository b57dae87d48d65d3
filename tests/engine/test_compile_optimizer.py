"""Fused / foreach optimizers and the compiled optimizer step (issue 33 item 3)."""

from __future__ import annotations

import warnings

import pytest
import torch

from kiln import Trainer
from kiln.engine.compile import compile_optimizer_step
from kiln.strategies.capabilities import Capabilities
from kiln.utils.errors import ConfigError
from tests.distributed import compile_toy as toy


def _train(tmp_path, name: str, **overrides):
    model = toy.mlp()
    cfg = toy.kiln_config(
        str(tmp_path / name),
        batch=4,
        eval_batch=4,
        torch_compile_backend=None,
        eval_strategy="no",
        warmup_steps=2,
        max_grad_norm=0.5,
        weight_decay=0.01,
    )
    cfg.update(overrides)
    trainer = Trainer(model, cfg, train_dataset=toy.regression_data(18))
    trainer.fit()
    return trainer, model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ref"), "ref", optim="adamw_torch")[1]


@pytest.mark.parametrize("name,flag", [("adamw_torch_fused", "fused"), ("adamw_torch_foreach", "foreach")])
def test_fused_and_foreach_adamw_run_as_named_on_cpu_with_adamw_torch_weights(
    tmp_path, reference, monkeypatch, name, flag
):
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    trainer, model = _train(tmp_path, name, optim=name)
    assert all(group[flag] is True for group in trainer.optimizer.param_groups)
    assert len(calls) == (2 * 6 if flag == "fused" else 0)  # the fused CPU kernel, once per param group and step
    assert flag == "foreach" or trainer.optimizer.param_groups[0]["foreach"] in (None, False)  # fused, not foreach
    torch.testing.assert_close(toy.flat(model.parameters()), toy.flat(reference.parameters()), rtol=0, atol=1e-6)


def _compiled_step_run(tmp_path, name: str, **overrides):
    seen = toy.CountsPerStep()
    model = toy.mlp()
    cfg = toy.kiln_config(
        str(tmp_path / name),
        batch=4,
        eval_batch=4,
        eval_strategy="no",
        warmup_steps=2,
        max_grad_norm=0.5,
        weight_decay=0.01,
        optim="adamw_torch",
        **overrides,
    )
    cfg["train"] = {"torch_compile_optimizer_step": True}
    toy.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(model, cfg, train_dataset=toy.regression_data(18), callbacks=[seen])
        trainer.fit()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]  # the scheduler still sees the steps
    assert getattr(trainer.optimizer.step, "_kiln_compiled", False)
    return trainer, model, seen


def test_compiled_optimizer_step_gives_the_weights_of_the_eager_step(tmp_path, reference):
    """Model and optimizer step through the counting aot_eager backend; the learning rate changes
    every step (warmup, then linear decay), yet nothing recompiles for it: step 2 (a new rate) adds no
    graph, step 3 adds the one of its short batch (2 rows of 18), and nothing after it. A float lr in the
    traced step recompiled at step 2 here (and twice more on an H100)."""
    trainer, model, seen = _compiled_step_run(tmp_path, "aot")
    torch.testing.assert_close(toy.flat(model.parameters()), toy.flat(reference.parameters()), rtol=1e-6, atol=1e-6)
    assert seen.steps[0] == seen.steps[1] > 0
    assert seen.steps[-1] == seen.steps[2] == seen.steps[1] + 1
    assert all(isinstance(group["lr"], float) for group in trainer.optimizer.param_groups)  # floats outside the step


@pytest.mark.heavy
def test_compiled_optimizer_step_with_inductor_alone(tmp_path, reference):
    """The default backend (inductor's C++ kernels on this CPU), the model left eager: 15-85 s of C++
    compilation on 2 cores, so `-m heavy`."""
    trainer, model, _ = _compiled_step_run(tmp_path, "inductor", torch_compile_backend=None)
    assert not hasattr(trainer.model_wrapped, "_orig_mod")
    torch.testing.assert_close(toy.flat(model.parameters()), toy.flat(reference.parameters()), rtol=1e-6, atol=1e-6)


def test_a_scheduler_built_after_the_step_was_compiled_sees_every_step():
    """auto_find_batch_size builds the scheduler later: torch's scheduler wraps `optimizer.step` as a
    bound method unless it is marked wrapped, and warns unless the step records that it ran."""
    train = type(
        "Train",
        (),
        {"torch_compile_optimizer_step": True, "torch_compile_backend": toy.BACKEND, "torch_compile_mode": None},
    )()
    model = toy.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compile_optimizer_step(optimizer, _Plain(), train)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    batch = toy.batches(toy.regression_data(4), 4)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(2):
            model(**batch)["loss"].backward()
            optimizer.step()
            schedule.step()
    assert schedule.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


class _OwnStep:
    name = "deepspeed"
    capabilities = Capabilities(owns_optimizer_step=True)


class _Plain:
    capabilities = Capabilities()


def test_compiled_step_is_refused_where_there_is_no_step_of_kilns_to_compile():
    cfg = type(
        "Train", (), {"torch_compile_optimizer_step": True, "torch_compile_backend": None, "torch_compile_mode": None}
    )()
    optimizer = torch.optim.SGD(toy.mlp().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="strategy 'deepspeed': its own engine runs the optimizer step"):
        compile_optimizer_step(optimizer, _OwnStep(), cfg)
    optimizer.owns_backward = True  # LOMO
    with pytest.raises(ConfigError, match="updates the weights inside backward"):
        compile_optimizer_step(optimizer, _Plain(), cfg)


def test_an_unknown_compile_mode_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="'train.torch_compile_mode' is 'fastest'.*max-autotune"):
        Trainer(toy.mlp(), toy.kiln_config(str(tmp_path), batch=4, eval_batch=4, torch_compile_mode="fastest"))
