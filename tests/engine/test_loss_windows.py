"""The logged `loss` is the mean over the steps of its own logging window, as HF's
`tr_loss / (global_step - _globalstep_last_logged)`: not over `logging_steps`. The two differ only
when a window is shorter than `logging_steps`: the first step logged by `logging_first_step`, and the
window after it (steps 2..logging_steps)."""

from __future__ import annotations

import pytest

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, regression_data


class Recorded(TinyRegressor):
    """Keeps every step's loss (one micro-batch per step), as the loop received it."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.losses.append(loss.item())
        return loss


def test_first_step_and_the_short_window_after_it_are_means_of_their_own_steps(tmp_path):
    model = Recorded()
    cfg = base_config(tmp_path, max_steps=7, logging_first_step=True, learning_rate=1e-2)
    cfg["log"]["steps"] = 5  # logs at steps 1 and 5: windows of 1 and 4 steps, both shorter than 5
    trainer = Trainer(model, cfg, train_dataset=regression_data(64))
    out = trainer.fit()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    losses = model.losses
    assert [h["step"] for h in logged] == [1, 5] and len(losses) == 7
    assert logged[0]["loss"] == pytest.approx(losses[0], rel=1e-6)
    assert logged[1]["loss"] == pytest.approx(sum(losses[1:5]) / 4, rel=1e-6)
    assert out.training_loss == pytest.approx(sum(losses) / 7, rel=1e-6)  # every step, the two left unlogged too


def test_the_logged_loss_and_train_loss_are_means_over_the_ranks(tmp_path):
    """Two ranks on threads (tests/topology/fake_world.py), each on its own data shard: every rank logs the
    mean over both ranks of its window means, and the same train_loss (docs/distributed.md)."""
    from tests.topology.fake_world import ThreadWorld

    world = ThreadWorld(nodes=1, per_node=2)
    models = [Recorded(), Recorded()]

    def fit(rank: int):
        cfg = base_config(tmp_path, max_steps=4, learning_rate=1e-2)
        cfg["log"]["steps"] = 2
        trainer = Trainer(models[rank], cfg, train_dataset=regression_data(64), strategy=world.strategy(rank))
        out = trainer.fit()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], out.training_loss

    results = world.run(fit)
    own = [model.losses for model in models]
    assert own[0] != own[1]  # the shards differ, so a rank's own mean would not do
    windows = [(sum(own[0][s : s + 2]) + sum(own[1][s : s + 2])) / 4 for s in (0, 2)]
    for logged, training_loss in results:
        assert logged == pytest.approx(windows, rel=1e-6)
        assert training_loss == pytest.approx((sum(own[0]) + sum(own[1])) / 8, rel=1e-6)
