"""Optimizers by HF `optim` name, weight-decay parameter groups and `optim_args`."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from kiln.config.schema.optim import OptimConfig
from kiln.optim.optimizers import (
    OPTIMIZERS,
    build_optimizer,
    decay_parameter_names,
    is_norm_module,
    parameter_groups,
    parse_optim_args,
)
from kiln.registry import UnknownNameError

BUILT_IN = [
    "adamw_torch",
    "adamw_hf",
    "adamw_torch_fused",
    "adamw_torch_foreach",
    "adam",
    "sgd",
    "adagrad",
    "adafactor",
    "rmsprop",
]


class MyRMSNorm(nn.Module):
    """A custom RMSNorm as HF models define them (not a torch norm class)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))  # a parameter on the root module
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.norm = MyRMSNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 10)
        self.head.weight = self.embed.weight  # tied: one parameter, two owners

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.ln(torch.relu(self.proj(self.embed(ids)))))
        return self.head(self.frozen(x) * self.scale)


def _loss(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(6).reshape(2, 3)
    return nn.functional.cross_entropy(model(ids).reshape(-1, 10), ids.reshape(-1))


def _train(name: str, steps: int = 1, **cfg: Any) -> Toy:
    torch.manual_seed(0)
    model = Toy()
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=1e-2, weight_decay=0.1, **cfg))
    for _ in range(steps):
        optimizer.zero_grad()
        _loss(model).backward()
        optimizer.step()
    return model


# ----------------------------------------------------------------------------- parameter groups


def test_weight_decay_groups_skip_biases_and_norm_weights() -> None:
    model = Toy()
    assert decay_parameter_names(model) == ["scale", "embed.weight", "proj.weight"]
    groups = parameter_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in groups] == [
        ["scale", "embed.weight", "proj.weight"],
        ["proj.bias", "ln.weight", "ln.bias", "norm.weight", "head.bias"],
    ]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    # the tied head.weight is embed.weight, counted once; the frozen layer is left out
    assert sum(len(g["params"]) for g in groups) == len([p for p in model.parameters() if p.requires_grad])


def test_optimizer_param_groups_match_parameter_groups() -> None:
    model = Toy()
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.05))
    expected = parameter_groups(model, 0.05)
    assert [[id(p) for p in g["params"]] for g in optimizer.param_groups] == [
        [id(p) for p in g["params"]] for g in expected
    ]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]


def test_empty_groups_are_kept_as_hf_does_and_no_trainable_parameters_is_an_error() -> None:
    layer_norm = parameter_groups(nn.LayerNorm(4), 0.1)
    assert [g["weight_decay"] for g in layer_norm] == [0.1, 0.0] and layer_norm[0]["params"] == []
    no_bias = parameter_groups(nn.Linear(4, 4, bias=False), 0.1)
    assert [g["weight_decay"] for g in no_bias] == [0.1, 0.0] and no_bias[1]["params"] == []
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(nn.Linear(2, 2).requires_grad_(False), OptimConfig())


@pytest.mark.parametrize(
    "module",
    [
        nn.LayerNorm(4),
        nn.GroupNorm(2, 4),
        nn.BatchNorm1d(4),
        nn.BatchNorm2d(4),
        nn.SyncBatchNorm(4),
        nn.RMSNorm(4),
        nn.InstanceNorm1d(4, affine=True),
        MyRMSNorm(4),
    ],
    ids=lambda m: type(m).__name__,
)
def test_norm_layers_are_recognised(module: nn.Module) -> None:
    assert is_norm_module(module)
    assert decay_parameter_names(module) == []


def test_linear_and_embedding_are_not_norms() -> None:
    assert not is_norm_module(nn.Linear(2, 2)) and not is_norm_module(nn.Embedding(2, 2))


# ----------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_optimizer_builds_and_steps(name: str) -> None:
    torch.manual_seed(0)
    before = Toy().state_dict()
    try:
        after = _train(name).state_dict()
    except RuntimeError as err:  # a torch without a CPU fused kernel
        pytest.skip(f"{name} cannot run on this CPU torch: {err}")
    for key in ("embed.weight", "proj.weight", "proj.bias", "ln.weight", "norm.weight", "scale"):
        assert not torch.equal(before[key], after[key]), key
    assert torch.equal(before["frozen.weight"], after["frozen.weight"])


def test_adamw_fused_and_foreach_match_adamw_torch() -> None:
    reference = _train("adamw_torch", steps=5).state_dict()
    for name in ("adamw_torch_fused", "adamw_torch_foreach"):
        try:
            result = _train(name, steps=5).state_dict()
        except RuntimeError as err:
            pytest.skip(f"fused AdamW is not supported on CPU by torch {torch.__version__}: {err}")
        for key, value in reference.items():
            torch.testing.assert_close(result[key], value, msg=f"{name}: {key}")


def test_adam_family_takes_betas_and_eps_from_config() -> None:
    cfg = OptimConfig(name="adamw_torch_fused", lr=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    optimizer = build_optimizer(Toy(), cfg)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["betas"] == (0.8, 0.95) and optimizer.defaults["eps"] == 1e-6
    assert optimizer.defaults["lr"] == 3e-4 and optimizer.defaults["fused"] is True
    assert type(build_optimizer(Toy(), OptimConfig(name="adafactor"))) is torch.optim.Adafactor


@pytest.mark.parametrize(
    "cfg",
    [
        OptimConfig(name="SGD", lr=0.1, optim_args="momentum=0.9"),
        OmegaConf.structured(OptimConfig(name="sgd", lr=0.1, optim_args="momentum=0.9")),
        {"name": "sgd", "lr": 0.1, "optim_args": "momentum=0.9"},
    ],
    ids=["dataclass", "dictconfig", "dict"],
)
def test_build_optimizer_accepts_every_config_form(cfg: Any) -> None:
    optimizer = build_optimizer(Toy(), cfg)
    assert type(optimizer) is torch.optim.SGD
    assert optimizer.defaults["lr"] == 0.1 and optimizer.defaults["momentum"] == 0.9


def test_every_transformers_optimizer_name_is_registered() -> None:
    pytest.importorskip("transformers")
    from transformers.training_args import OptimizerNames

    hf_names = {n.value for n in OptimizerNames}
    assert hf_names <= set(OPTIMIZERS.names()), sorted(hf_names - set(OPTIMIZERS.names()))


# ----------------------------------------------------------------------------- optim_args


def test_parse_optim_args_types() -> None:
    parsed = parse_optim_args(
        " momentum=0.9, nesterov=True,dampening=0,flag=false,x=None,name=hello,eps=1e-3,betas=(0.9, 0.95),neg=-2"
    )
    assert parsed == {
        "momentum": 0.9,
        "nesterov": True,
        "dampening": 0,
        "flag": False,
        "x": None,
        "name": "hello",
        "eps": 1e-3,
        "betas": (0.9, 0.95),
        "neg": -2,
    }
    assert [type(parsed[k]) for k in ("momentum", "nesterov", "dampening", "name")] == [float, bool, int, str]
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}


@pytest.mark.parametrize(
    "name,optim_args,expected",
    [
        ("sgd", "momentum=0.9,nesterov=True", {"momentum": 0.9, "nesterov": True}),
        ("rmsprop", "alpha=0.9,centered=true,momentum=0.5", {"alpha": 0.9, "centered": True, "momentum": 0.5}),
        (
            "adagrad",
            "lr_decay=0.01,initial_accumulator_value=0.1",
            {"lr_decay": 0.01, "initial_accumulator_value": 0.1},
        ),
        ("adafactor", "beta2_decay=-0.5,eps=(None, 0.01),d=2.0", {"beta2_decay": -0.5, "eps": (None, 0.01), "d": 2.0}),
        ("adamw_torch", "amsgrad=True", {"amsgrad": True}),
    ],
)
def test_optim_args_reach_the_optimizer(name: str, optim_args: str, expected: dict[str, Any]) -> None:
    optimizer = build_optimizer(Toy(), OptimConfig(name=name, optim_args=optim_args))
    assert {k: optimizer.defaults[k] for k in expected} == expected


# ----------------------------------------------------------------------------- errors


def test_unknown_optimizer_name_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError) as err:
        build_optimizer(Toy(), OptimConfig(name="adamw_torchh"))
    message = str(err.value)
    assert "Unknown optimizer 'adamw_torchh' in `optim.name`." in message
    assert "Did you mean 'adamw_torch'?" in message
    assert all(name in message for name in BUILT_IN)


@pytest.mark.parametrize(
    "optim_args,bad",
    [
        ("momentum", "'momentum' is not of the form key=value"),
        ("=0.9", "'=0.9' is not of the form key=value"),
        ("momentum=", "'momentum=' is not of the form key=value"),
        ("momentum=0.9,,nesterov=True", "'' is not of the form key=value"),
        ("momentum=0.9,momentum=0.8", "'momentum=0.8' is a repeated key"),
        ("2x=1", "'2x=1' is not of the form key=value"),
    ],
)
def test_malformed_optim_args(optim_args: str, bad: str) -> None:
    with pytest.raises(ValueError) as err:
        build_optimizer(Toy(), OptimConfig(name="sgd", optim_args=optim_args))
    assert str(err.value).startswith(f"Cannot parse `optim.optim_args` {optim_args!r}: {bad}")


def test_unknown_optim_args_key_names_optim_args() -> None:
    with pytest.raises(ValueError) as err:
        build_optimizer(Toy(), OptimConfig(name="sgd", optim_args="momentun=0.9"))
    message = str(err.value)
    assert message.startswith("`optim.optim_args` sets 'momentun', which SGD (optimizer 'sgd') does not take;")
    assert "momentum" in message and "nesterov" in message
    with pytest.raises(ValueError, match=r"sets 'eps', which SGD \(optimizer 'sgd'\) does not take"):
        build_optimizer(Toy(), OptimConfig(name="sgd", optim_args="eps=1e-3"))


@pytest.mark.parametrize(
    "name,optim_args,source",
    [
        ("sgd", "lr=0.1", "optim.lr"),
        ("adamw_torch", "weight_decay=0.1", "optim.weight_decay"),
        ("adamw_torch", "betas=(0.9, 0.95)", "optim.adam_beta1 / optim.adam_beta2"),
        ("adam", "eps=1e-6", "optim.adam_epsilon"),
        ("adamw_torch_fused", "fused=False", "optim.name='adamw_torch_fused'"),
    ],
)
def test_optim_args_may_not_repeat_config_fields(name: str, optim_args: str, source: str) -> None:
    key = optim_args.split("=")[0]
    with pytest.raises(
        ValueError,
        match=f"`optim.optim_args` sets '{key}', which optimizer '{name}' takes from {source}; set it there.",
    ):
        build_optimizer(Toy(), OptimConfig(name=name, optim_args=optim_args))


def test_optimizer_rejecting_its_arguments_names_optim_args() -> None:
    with pytest.raises(
        ValueError,
        match=r"Optimizer 'sgd' rejected its arguments \(Nesterov momentum requires .*\); "
        r"check .*optim.optim_args",
    ):
        build_optimizer(Toy(), OptimConfig(name="sgd", optim_args="nesterov=True"))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_bitsandbytes_optimizer_without_the_package_says_what_to_install() -> None:
    with pytest.raises(
        ImportError,
        match=r"Optimizer 'adamw_bnb_8bit' \(`optim.name`\) needs bitsandbytes: "
        r"pip install bitsandbytes, or use optim.name=adamw_torch\.",
    ):
        build_optimizer(Toy(), OptimConfig(name="adamw_bnb_8bit"))


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_xla_optimizer_without_torch_xla_says_what_to_install() -> None:
    with pytest.raises(ImportError, match=r"needs torch_xla: pip install kiln\[xla\]"):
        build_optimizer(Toy(), OptimConfig(name="adamw_torch_xla"))


@pytest.mark.parametrize(
    "name,instead",
    [
        ("stable_adamw", "register it with kiln.optim.optimizers.OPTIMIZERS.add"),
        ("adamw_apex_fused", "use adamw_torch_fused"),
    ],
)
def test_unsupported_optimizer_says_what_to_use(name: str, instead: str) -> None:
    with pytest.raises(ValueError, match=f"Optimizer '{name}' \\(`optim.name`\\) is not supported by kiln; {instead}"):
        build_optimizer(Toy(), OptimConfig(name=name))
