"""HF Trainer API details: metric-driven schedulers of any class, get_optimizer_group /
get_learning_rates, and the eval dataloader kept (with its workers) under persistent workers."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.optim.schedulers import scheduler_needs_metrics
from tests.helpers import TinyRegressor, base_config, regression_data


class HalveOnMetric:
    """A user's own metric-driven schedule: not a torch or kiln class, `step(metrics)` like ReduceLROnPlateau."""

    def __init__(self, optimizer):
        self.optimizer, self.seen = optimizer, []

    def step(self, metrics, epoch=None):
        self.seen.append(float(metrics))
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


def _fit_with(tmp_path, make_scheduler):
    model = TinyRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = make_scheduler(opt)
    cfg = base_config(
        tmp_path, max_steps=4, per_device_train_batch_size=8, eval_strategy="steps", eval_steps=2, logging_steps=1
    )
    trainer = Trainer(
        model, cfg, train_dataset=regression_data(32), eval_dataset=regression_data(16, seed=1), optimizers=(opt, sched)
    )
    trainer.fit()
    return trainer, opt, sched


def test_a_users_metric_driven_scheduler_is_stepped_with_the_eval_metric(tmp_path):
    trainer, opt, sched = _fit_with(tmp_path, HalveOnMetric)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert sched.seen == pytest.approx(evals) and len(evals) == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05])  # each step's rate: halved after the step-2 evaluation


def test_transformers_greedy_lr_is_stepped_with_the_eval_metric(tmp_path):
    pytest.importorskip("transformers")
    from transformers.optimization import GreedyLR

    trainer, opt, sched = _fit_with(tmp_path, lambda o: GreedyLR(o, patience=0, factor=0.5, min_lr=1e-4))
    assert sched.last_epoch == 2  # stepped once per evaluation, never per optimizer step


def test_scheduler_needs_metrics_by_signature():
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    assert scheduler_needs_metrics(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    assert scheduler_needs_metrics(HalveOnMetric(opt))
    assert not scheduler_needs_metrics(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    assert not scheduler_needs_metrics(None)


def test_get_optimizer_group_and_learning_rates(tmp_path):
    trainer = Trainer(TinyRegressor(), base_config(tmp_path, learning_rate=0.01, weight_decay=0.1))
    with pytest.raises(ValueError, match="optimizer is None"):
        trainer.get_learning_rates()
    with pytest.raises(ValueError, match="optimizer is None"):
        trainer.get_optimizer_group()
    trainer.create_optimizer()
    assert trainer.get_learning_rates() == [0.01, 0.01]
    weight, bias = trainer.model.net[0].weight, trainer.model.net[0].bias
    assert trainer.get_optimizer_group(weight)["weight_decay"] == 0.1
    assert trainer.get_optimizer_group("net.0.bias")["weight_decay"] == 0.0
    groups = trainer.get_optimizer_group()
    assert len(groups) == 2 and any(p is bias for p in groups[1])


def _worker_pids(loader):
    iterator = getattr(loader, "_iterator", None)
    return [w.pid for w in iterator._workers] if iterator is not None else None


@pytest.mark.parametrize("persistent", [True, False])
def test_eval_dataloader_is_built_once_with_persistent_workers(tmp_path, persistent):
    cfg = base_config(tmp_path, dataloader_num_workers=1, dataloader_persistent_workers=persistent)
    trainer = Trainer(TinyRegressor(), cfg, eval_dataset=regression_data(8))
    trainer.evaluate()
    first = trainer.get_eval_dataloader()
    pids = _worker_pids(first)
    trainer.evaluate()
    second = trainer.get_eval_dataloader()
    if persistent:
        assert first is second and pids is not None and _worker_pids(second) == pids
    else:
        assert first is not second
    assert trainer.get_eval_dataloader(regression_data(4)) is not trainer.get_eval_dataloader(regression_data(4))
