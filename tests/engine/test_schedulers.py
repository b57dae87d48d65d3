"""Learning-rate schedules: every HF `lr_scheduler_type` gives the same learning rates as transformers,
step for step, with default and non-default `lr_scheduler_kwargs`."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from kiln.config.schema.optim import SchedulerConfig
from kiln.optim.schedulers import (
    SCHEDULERS,
    GreedyLR,
    build_scheduler,
    get_scheduler,
    scheduler_needs_metrics,
    warmup_steps_for,
)
from kiln.registry import UnknownNameError

LR = 1e-3
TOTAL = 40

# (name, lr_scheduler_kwargs): each name with its defaults and with every kwarg changed
CASES: list[tuple[str, dict[str, Any]]] = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}),
    ("polynomial", {"lr_end": 1e-4, "power": 2.0}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {}),
    ("inverse_sqrt", {"timescale": 7}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_with_min_lr", {"min_lr": 1e-4, "num_cycles": 0.7}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 2e-4, "num_cycles": 0.4, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", {"num_decay_steps": 10}),
    (
        "warmup_stable_decay",
        {
            "num_decay_steps": 8,
            "num_stable_steps": 12,
            "warmup_type": "cosine",
            "decay_type": "1-sqrt",
            "min_lr_ratio": 0.1,
        },
    ),
    ("warmup_stable_decay", {"num_decay_steps": 15, "warmup_type": "1-sqrt", "decay_type": "linear"}),
    ("warmup_stable_decay", {"num_decay_steps": 15, "decay_type": "cosine", "num_cycles": 0.3}),
]


def _optimizer() -> torch.optim.Optimizer:
    """Two param groups with different lrs, as build_optimizer makes (decay / no-decay)."""
    model = nn.Linear(3, 2)
    return torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": LR / 2}], lr=LR)


def _lrs(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int) -> list[list[float]]:
    lrs = []
    for _ in range(steps):
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.filterwarnings("ignore:Both num_training_steps and num_stable_steps")  # HF's, for the case that sets both
@pytest.mark.parametrize("warmup", [0, 7])
@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_schedule_matches_transformers(name: str, kwargs: dict[str, Any], warmup: int) -> None:
    transformers = pytest.importorskip("transformers")
    ours_opt, hf_opt = _optimizer(), _optimizer()
    ours = get_scheduler(name, ours_opt, warmup, TOTAL, **kwargs)
    hf = transformers.get_scheduler(
        name, hf_opt, num_warmup_steps=warmup, num_training_steps=TOTAL, scheduler_specific_kwargs=dict(kwargs)
    )
    assert _lrs(ours, ours_opt, TOTAL + 5) == _lrs(hf, hf_opt, TOTAL + 5)  # exact, and past the end


def test_every_transformers_scheduler_type_is_registered() -> None:
    transformers = pytest.importorskip("transformers")
    hf_names = {t.value for t in transformers.SchedulerType}
    assert hf_names <= set(SCHEDULERS.names()), hf_names - set(SCHEDULERS.names())
    assert {name for name, _ in CASES} | {"reduce_lr_on_plateau", "greedy"} == set(SCHEDULERS.names())


@pytest.mark.parametrize(
    "cfg",
    [
        SchedulerConfig(name="cosine", warmup_ratio=0.1),
        OmegaConf.structured(SchedulerConfig(name="cosine", warmup_ratio=0.1)),
        {"name": "cosine", "warmup_ratio": 0.1},
    ],
)
def test_build_scheduler_resolves_warmup_ratio_like_hf(cfg: Any) -> None:
    transformers = pytest.importorskip("transformers")
    total = 45  # 0.1 * 45 = 4.5 -> 5 warmup steps (HF rounds up)
    assert warmup_steps_for(cfg, total) == 5
    hf_args = SimpleNamespace(warmup_steps=0.1)  # HF 5 folds warmup_ratio into a fractional warmup_steps
    assert transformers.TrainingArguments.get_warmup_steps(hf_args, total) == 5  # (building one takes seconds)
    ours_opt, hf_opt = _optimizer(), _optimizer()
    ours = build_scheduler(ours_opt, cfg, total)
    hf = transformers.get_scheduler("cosine", hf_opt, num_warmup_steps=5, num_training_steps=total)
    assert _lrs(ours, ours_opt, total + 1) == _lrs(hf, hf_opt, total + 1)


def test_warmup_steps_override_warmup_ratio() -> None:
    assert warmup_steps_for(SchedulerConfig(warmup_steps=3, warmup_ratio=0.5), 100) == 3
    assert warmup_steps_for(SchedulerConfig(warmup_steps=0, warmup_ratio=0.5), 100) == 50
    assert warmup_steps_for(SchedulerConfig(), 100) == 0


def test_build_scheduler_passes_kwargs_from_dictconfig() -> None:
    cfg = OmegaConf.structured(
        SchedulerConfig(
            name="warmup_stable_decay", warmup_steps=2, kwargs={"num_decay_steps": 4, "decay_type": "linear"}
        )
    )
    optimizer = _optimizer()
    lrs = [lr for lr, _ in _lrs(build_scheduler(optimizer, cfg, 10), optimizer, 11)]
    assert lrs[:7] == pytest.approx([0.0, LR / 2, LR, LR, LR, LR, LR])
    assert lrs[7:] == pytest.approx([0.75 * LR, 0.5 * LR, 0.25 * LR, 0.0])


def test_reduce_lr_on_plateau_lowers_lr_after_patience_bad_metrics() -> None:
    optimizer = _optimizer()
    scheduler = get_scheduler("reduce_lr_on_plateau", optimizer, 0, 100, patience=2, factor=0.5)
    assert scheduler_needs_metrics(scheduler)
    scheduler.step(1.0)  # the first metric is an improvement
    for _ in range(2):  # `patience` non-improving metrics are tolerated ...
        scheduler.step(1.0)
        assert optimizer.param_groups[0]["lr"] == LR
    scheduler.step(1.0)  # ... one more lowers the lr
    assert [g["lr"] for g in optimizer.param_groups] == [LR * 0.5, LR / 2 * 0.5]


def test_reduce_lr_on_plateau_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    kwargs = {"mode": "max", "factor": 0.3, "patience": 1, "cooldown": 1, "min_lr": 1e-4}
    ours_opt, hf_opt = _optimizer(), _optimizer()
    ours = get_scheduler("reduce_lr_on_plateau", ours_opt, 0, 10, **kwargs)
    hf = transformers.get_scheduler("reduce_lr_on_plateau", hf_opt, scheduler_specific_kwargs=kwargs)
    for metric in [0.5, 0.6, 0.6, 0.6, 0.55, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]:
        ours.step(metric)
        hf.step(metric)
        assert ours.get_last_lr() == hf.get_last_lr()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"patience": 2, "factor": 0.5, "min_lr": 1e-4, "max_lr": 4e-3, "reset_start": 3},
        {
            "patience": 1,
            "mode": "max",
            "threshold": 0.01,
            "threshold_mode": "rel",
            "cooldown": 1,
            "warmup": 2,
            "smooth": True,
            "window_size": 3,
            "min_lr": [1e-4, 2e-4],
        },
    ],
)
def test_greedy_matches_transformers(kwargs: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.optimization, "GreedyLR"):
        pytest.skip("this transformers has no GreedyLR")
    ours_opt, hf_opt = _optimizer(), _optimizer()
    ours = get_scheduler("greedy", ours_opt, 0, 10, **kwargs)
    hf = transformers.get_scheduler("greedy", hf_opt, scheduler_specific_kwargs=kwargs)
    assert isinstance(ours, GreedyLR) and scheduler_needs_metrics(ours)
    metrics = [
        1.0,
        0.9,
        0.8,
        0.7,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.5,
        0.4,
        0.3,
        0.2,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
    ]
    for i, metric in enumerate(metrics):
        if i == len(metrics) // 2:  # resume mid-way from a state_dict, as from a checkpoint
            state = ours.state_dict()
            ours = GreedyLR(ours_opt, **kwargs)
            ours.load_state_dict(state)
        ours.step(metric)
        hf.step(metric)
        assert ours.get_last_lr() == hf.get_last_lr(), i
    assert ours.state_dict() == hf.state_dict()


def test_lambda_schedulers_do_not_need_metrics() -> None:
    optimizer = _optimizer()
    assert not scheduler_needs_metrics(get_scheduler("linear", optimizer, 0, 10))


def test_scheduler_state_loads_with_weights_only_and_resumes_exactly() -> None:
    first_opt = _optimizer()
    first = get_scheduler("cosine_with_min_lr", first_opt, 3, 20, min_lr_rate=0.1)
    expected = _lrs(first, first_opt, 20)
    opt = _optimizer()
    scheduler = get_scheduler("cosine_with_min_lr", opt, 3, 20, min_lr_rate=0.1)
    head = _lrs(scheduler, opt, 8)
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    new_opt = _optimizer()  # a resumed run builds both, then loads both (the optimizer state holds the lr)
    resumed = get_scheduler("cosine_with_min_lr", new_opt, 3, 20, min_lr_rate=0.1)
    new_opt.load_state_dict(state["optimizer"])
    resumed.load_state_dict(state["scheduler"])
    assert head + _lrs(resumed, new_opt, 12) == expected


def test_unknown_scheduler_name_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError) as err:
        get_scheduler("cosin", _optimizer(), 0, 10)
    message = str(err.value)
    assert "`scheduler.name`" in message and "Did you mean 'cosine'?" in message
    assert "warmup_stable_decay" in message and "reduce_lr_on_plateau" in message


def test_unknown_scheduler_kwarg_names_scheduler_kwargs() -> None:
    with pytest.raises(
        ValueError,
        match=r"Unknown argument 'num_cycle' in `scheduler.kwargs` for lr scheduler "
        r"'cosine'; it accepts: num_cycles\.",
    ):
        get_scheduler("cosine", _optimizer(), 0, 10, num_cycle=2)
    with pytest.raises(ValueError, match=r"'power' in `scheduler.kwargs` for lr scheduler 'linear'; it accepts: no"):
        build_scheduler(_optimizer(), SchedulerConfig(name="linear", kwargs={"power": 2.0}), 10)
    with pytest.raises(ValueError, match=r"'patiense' in `scheduler.kwargs` .*'reduce_lr_on_plateau'.*patience"):
        get_scheduler("reduce_lr_on_plateau", _optimizer(), 0, 10, patiense=3)
    with pytest.raises(ValueError, match=r"'window' in `scheduler.kwargs` .*'greedy'.*window_size"):
        get_scheduler("greedy", _optimizer(), 0, 10, window=3)


@pytest.mark.parametrize(
    "name,kwargs,message",
    [
        ("cosine_with_min_lr", {}, "needs one of `scheduler.kwargs.min_lr` or `scheduler.kwargs.min_lr_rate`"),
        ("cosine_with_min_lr", {"min_lr": 1e-4, "min_lr_rate": 0.1}, "needs one of `scheduler.kwargs.min_lr`"),
        ("warmup_stable_decay", {}, "needs `scheduler.kwargs.num_decay_steps`"),
        (
            "warmup_stable_decay",
            {"num_decay_steps": 3, "decay_type": "exp"},
            "`scheduler.kwargs.decay_type` must be one of",
        ),
        ("polynomial", {"lr_end": 1.0}, r"`scheduler.kwargs.lr_end` \(1.0\) must be smaller than the initial lr"),
        ("greedy", {"factor": 1.5}, "factor < 1"),
    ],
)
def test_bad_scheduler_kwargs_name_the_key(name: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_scheduler(name, _optimizer(), 2, 10, **kwargs)
