"""HF `optim` names from optional packages (kiln.optim.package_optimizers): each one that installs here
trains a few steps with falling loss and resumes exactly from a checkpoint; optim_args reach it as
in HF; a missing package is one sentence naming it."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from typing import Any

import pytest
import torch

from kiln.config.schema.optim import OptimConfig
from kiln.optim.optimizers import build_optimizer
from tests.distributed import toy

PACKAGE = {
    "schedulefree": "schedulefree",
    "grokadamw": "grokadamw",
    "torchao": "torchao",
    "galore_torch": "galore-torch",
    "apollo_torch": "apollo-torch",
    "bitsandbytes": "bitsandbytes",
}
# name -> (module it needs, learning rate, extra config)
CASES: dict[str, tuple[str, float, dict[str, Any]]] = {
    "schedule_free_adamw": ("schedulefree", 0.05, {"lr_scheduler_type": "constant"}),
    "schedule_free_radam": ("schedulefree", 0.3, {"lr_scheduler_type": "constant"}),  # its first steps are SGD-free
    "schedule_free_sgd": ("schedulefree", 0.05, {"lr_scheduler_type": "constant"}),
    "grokadamw": ("grokadamw", 0.05, {"optim_args": "lamb=3.0"}),
    "adamw_torch_4bit": ("torchao", 0.05, {}),
    "adamw_torch_8bit": ("torchao", 0.05, {}),
    "galore_adamw": (
        "galore_torch",
        0.05,
        {"optim_target_modules": ["net.0"], "optim_args": "rank=2,update_proj_gap=2"},
    ),
    "galore_adafactor": ("galore_torch", 0.05, {"optim_target_modules": "net\\.0", "optim_args": "rank=2"}),
    "apollo_adamw": ("apollo_torch", 0.05, {"optim_target_modules": "all-linear", "optim_args": "rank=2,proj=random"}),
    "adamw_bnb_8bit": ("bitsandbytes", 0.05, {}),
    "lion_8bit": ("bitsandbytes", 0.01, {}),
    "paged_adamw_32bit": ("bitsandbytes", 0.05, {}),
    "rmsprop_bnb": ("bitsandbytes", 0.01, {}),
}


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{PACKAGE[module]} is not installed")


def _data_loss(model: torch.nn.Module) -> float:
    data = toy.regression_data(64, seed=5)
    x, y = torch.stack([d["x"] for d in data]), torch.stack([d["y"] for d in data])
    with torch.no_grad():
        return float(((model(x) - y) ** 2).mean())


def _fit(name: str, out: str, lr: float, extra: dict[str, Any], resume: Any = None, eval_dataset: Any = None):  # type: ignore[no-untyped-def]
    from kiln import Trainer

    torch.manual_seed(0)
    cfg = {
        "output_dir": out,
        "seed": 3,
        "optim": name,
        "learning_rate": lr,
        "max_steps": 8,
        "per_device_train_batch_size": 8,
        "save_steps": 4,
        "logging_steps": 1,
        "max_grad_norm": 0.0,
        "log": {"history": [], "disable_tqdm": True},
        "strategy": {"name": "single", "device": "cpu"},
        **extra,
    }
    model = toy.Regressor()
    trainer = Trainer(model, cfg, train_dataset=toy.regression_data(64, seed=5), eval_dataset=eval_dataset)
    trainer.fit(resume_from_checkpoint=resume)
    return trainer, model


@pytest.mark.parametrize("name", list(CASES))
def test_optional_optimizer_trains_and_resumes_exactly(name, tmp_path):
    module, lr, extra = CASES[name]
    _needs(module)
    trainer, model = _fit(name, str(tmp_path / "full"), lr, extra)
    assert type(trainer.optimizer).__module__.split(".")[0] == module
    torch.manual_seed(0)
    assert len(toy.losses(trainer)) == 8
    assert _data_loss(model) < 0.9 * _data_loss(toy.Regressor())  # the same initial weights, untrained
    shutil.copytree(tmp_path / "full" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    _, resumed = _fit(name, str(tmp_path / "resumed"), lr, extra, resume=True)
    if name == "grokadamw":  # kept in param_groups keyed by tensor, its moments are not in state_dict()
        assert not torch.equal(toy.flat_params(resumed), toy.flat_params(model)), "grokadamw resumes exactly now"
        pytest.xfail("grokadamw 0.1.2 keeps its moments outside optimizer.state, so no checkpoint restores them")
    torch.testing.assert_close(toy.flat_params(resumed), toy.flat_params(model), rtol=0, atol=0)


def test_galore_8bit_is_registered():
    _needs("galore_torch")
    cls, _ = build_optimizer.__globals__["OPTIMIZERS"].get("galore_adamw_8bit")(OptimConfig(name="galore_adamw_8bit"))
    assert cls.__name__ == "AdamW8bit"  # bitsandbytes' 8-bit kernels need CUDA, so it is not trained here


def test_optim_args_reach_the_optional_optimizers():
    _needs("grokadamw")
    _needs("galore_torch")
    opt = build_optimizer(toy.Regressor(), OptimConfig(name="grokadamw", optim_args="lamb=3.0,gamma=0.2"))
    assert opt.defaults["lamb"] == 3.0 and opt.defaults["gamma"] == 0.2 and opt.defaults["alpha_init"] == 0.98
    opt = build_optimizer(
        toy.Regressor(), OptimConfig(name="galore_adamw", target_modules=["net.0"], optim_args="rank=4,scale=0.5")
    )
    target = opt.param_groups[-1]
    assert (target["rank"], target["scale"], target["update_proj_gap"], target["proj_type"]) == (4, 0.5, 200, "std")
    assert len(target["params"]) == 1 and target["params"][0].shape == (12, 6)  # net.0.weight only
    assert all("rank" not in g for g in opt.param_groups[:-1])


def test_galore_needs_target_modules_that_match():
    _needs("galore_torch")
    with pytest.raises(
        ValueError, match=r"^Optimizer 'galore_adamw' needs optim.target_modules \(optim_target_modules\)"
    ):
        build_optimizer(toy.Regressor(), OptimConfig(name="galore_adamw"))
    with pytest.raises(ValueError, match=r"^optim.target_modules=\['attn'\] matches no nn.Linear of the model"):
        build_optimizer(toy.Regressor(), OptimConfig(name="galore_adamw", target_modules=["attn"]))


@pytest.mark.parametrize(
    "name,pip_name",
    [
        ("schedule_free_adamw", "schedulefree"),
        ("grokadamw", "grokadamw"),
        ("adamw_torch_4bit", "torchao"),
        ("galore_adamw", "galore-torch"),
        ("apollo_adamw", "apollo-torch"),
    ],
)
def test_missing_package_is_one_sentence(name, pip_name, monkeypatch):
    module = {"galore-torch": "galore_torch", "apollo-torch": "apollo_torch", "torchao": "torchao.optim"}.get(
        pip_name, pip_name
    )
    monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    with pytest.raises(
        ImportError,
        match=f"^Optimizer '{name}' \\(`optim.name`\\) needs the {pip_name} package: pip install {pip_name}\\.$",
    ):
        build_optimizer(toy.Regressor(), OptimConfig(name=name, target_modules="all-linear"))


def test_schedule_free_evaluates_the_averaged_weights_and_trains_on(tmp_path):
    _needs("schedulefree")
    data = toy.regression_data(16, seed=9)
    trainer, model = _fit(
        "schedule_free_adamw",
        str(tmp_path),
        0.05,
        {"lr_scheduler_type": "constant", "eval_strategy": "steps", "eval_steps": 4},
        eval_dataset=data,
    )
    assert trainer.optimizer.param_groups[0]["train_mode"]  # back in train mode after the evaluations in fit
    metrics = trainer.evaluate(data)
    assert not trainer.optimizer.param_groups[0]["train_mode"]  # HF leaves it in eval mode outside training
    x = torch.stack([d["x"] for d in data])
    y = torch.stack([d["y"] for d in data])
    assert metrics["eval_loss"] == pytest.approx(float(((model(x) - y) ** 2).mean()), rel=1e-5)
    trainer.optimizer.train()
    assert float(((model(x) - y) ** 2).mean()) != pytest.approx(metrics["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["galore_adamw_layerwise", "apollo_adamw_layerwise"])
def test_step_inside_backward_optimizers_are_refused(name):
    with pytest.raises(ValueError, match=f"^Optimizer '{name}' \\(`optim.name`\\) is not supported by kiln; "):
        build_optimizer(toy.Regressor(), OptimConfig(name=name))
