"""HF's two optimizer param groups (decay / no decay) always, as HF builds them even without weight
decay; checkpoints of older kiln versions, which kept one group without weight decay, resume in the two
(kiln.utils.param_groups), and a layout that cannot be merged back is refused clearly."""

from __future__ import annotations

import pytest
import torch

from kiln.optim import optimizers
from kiln.optim.optimizers import parameter_groups
from kiln.utils.errors import CheckpointError
from kiln.utils.param_groups import regroup_optimizer_state, regroup_scheduler_state
from tests.checkpoint.checkpoint_helpers import Crash, make_model, numeric_history, train, weights

CFG = {"max_steps": 12, "save_steps": 5, "lr_scheduler_type": "cosine", "warmup_steps": 3}


def one_group(model, weight_decay):
    """The layout older kiln versions used without weight decay: one group, the two groups' parameters in order."""
    return [
        {
            "params": [p for g in parameter_groups(model, weight_decay) for p in g["params"]],
            "weight_decay": weight_decay,
        }
    ]


def crash(tmp_path, monkeypatch, layout=None, **cfg):
    """Train until the checkpoint at step 5 and 'crash' there; `layout` replaces parameter_groups meanwhile."""
    out = str(tmp_path / "crashed")
    with monkeypatch.context() as m:
        if layout is not None:
            m.setattr(optimizers, "parameter_groups", layout)
        with pytest.raises(Crash):
            train(out, {**CFG, **cfg}, crash_at=5)
    return out


def test_without_weight_decay_there_are_still_hfs_two_groups():
    model = make_model()
    groups = parameter_groups(model, 0.0)
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0]
    assert [[id(p) for p in g["params"]] for g in groups] == [
        [id(p) for p in g["params"]] for g in parameter_groups(model, 0.1)
    ]
    assert [g["weight_decay"] for g in parameter_groups(model, 0.1)] == [0.1, 0.0]


def test_an_older_one_group_checkpoint_resumes_bitwise_in_two_groups(tmp_path, monkeypatch):
    straight = train(str(tmp_path / "straight"), CFG)
    assert len(straight.optimizer.param_groups) == 2
    out = crash(tmp_path, monkeypatch, layout=one_group)
    assert len(torch.load(f"{out}/checkpoint-5/optimizer.pt")["param_groups"]) == 1
    resumed = train(out, CFG, model_seed=1234, resume=True)
    assert len(resumed.optimizer.param_groups) == 2
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert numeric_history(resumed) == numeric_history(straight)


def test_a_one_group_checkpoint_resumes_with_weight_decay_set_and_keeps_its_settings(tmp_path, monkeypatch):
    straight = train(str(tmp_path / "straight"), CFG)
    out = crash(tmp_path, monkeypatch, layout=one_group)
    resumed = train(out, {**CFG, "weight_decay": 0.01}, model_seed=1234, resume=True)
    # the saved settings win, as in any Optimizer.load_state_dict: both groups keep the saved decay of 0
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.0, 0.0]
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_groups_with_different_settings_are_not_merged(tmp_path, monkeypatch):
    out = crash(tmp_path, monkeypatch, weight_decay=0.01)  # two groups: decay 0.01 and 0
    monkeypatch.setattr(optimizers, "parameter_groups", one_group)  # a run with one group cannot take both
    with pytest.raises(CheckpointError, match="different weight_decay.*resume with the weight_decay"):
        train(out, CFG, model_seed=1234, resume=True)


def test_regroup_leaves_matching_or_foreign_layouts_to_load_state_dict():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    saved = opt.state_dict()
    assert regroup_optimizer_state(saved, opt.param_groups) is saved  # same group count
    other = torch.optim.SGD(params[:2], lr=0.1)
    assert regroup_optimizer_state(saved, other.param_groups) is saved  # 3 parameters saved, 2 here
    malformed = {"state": {}, "param_groups": {"params": [0, 1, 2]}}  # not a list of groups: load_state_dict says so
    assert regroup_optimizer_state(malformed, opt.param_groups) is malformed


def test_scheduler_state_follows_the_group_count():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]

    def schedule(groups):
        opt = torch.optim.AdamW(groups, lr=0.1)
        warm = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=3)
        return torch.optim.lr_scheduler.SequentialLR(
            opt, [warm, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)], [3]
        )

    two = schedule([{"params": params[:1]}, {"params": params[1:]}])
    for _ in range(4):
        two.optimizer.step()
        two.step()
    one = schedule(params)
    one.load_state_dict(regroup_scheduler_state(two.state_dict(), 1))
    assert one.get_last_lr() == two.get_last_lr()[:1] and one.last_epoch == two.last_epoch
    back = schedule([{"params": params[:1]}, {"params": params[1:]}])
    back.load_state_dict(regroup_scheduler_state(one.state_dict(), 2))
    assert back.get_last_lr() == two.get_last_lr()

    state = two.state_dict()
    state["_schedulers"][1]["base_lrs"] = [0.1, 0.5]  # groups with their own rates cannot become one
    with pytest.raises(ValueError, match="base_lrs holds 2 different per-group values"):
        regroup_scheduler_state(state, 1)
