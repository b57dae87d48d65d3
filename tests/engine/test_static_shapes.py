"""The static-shapes seam (`Capabilities.static_shapes`, which the XLA strategies declare): the Trainer drops
each epoch's short last training batch with one log line, and weighs a short accumulation window like
a full one whose missing micro-batches count zero items. Run here with a CPU strategy that sets it;
tests/xla/test_xla_static_shapes.py shows that XLA then compiles nothing new at an epoch's end."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln import Trainer
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.single import SingleDeviceStrategy
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data, train_step_of


class StaticShapes(SingleDeviceStrategy):
    capabilities = Capabilities(static_shapes=True)


def _trainer(tmp_path, name, strategy=None, **over):
    # 60 samples in batches of 8: 7 full batches and 4 samples left over; 2 micro-batches a window
    settings = dict(
        num_train_epochs=2,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_grad_norm=0.5,
    )
    cfg = base_config(tmp_path, **{**settings, **over})
    cfg["output_dir"] = str(tmp_path / name)
    torch.manual_seed(0)
    return Trainer(TinyRegressor(), cfg, train_dataset=regression_data(n=60), strategy=strategy)


def test_static_shapes_drop_the_short_last_batch_with_one_log_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.engine.data.static_shapes"):
        static = _trainer(tmp_path, "static", StaticShapes)
        out = static.fit()
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.engine.data.static_shapes"]
    assert len(lines) == 1 and "drops 4 sample(s) of each epoch" in lines[0], lines
    dropped = _trainer(tmp_path, "drop_last", dataloader_drop_last=True)
    assert dropped.fit().global_step == out.global_step == 8  # 7 batches, windows of 2: 4 steps an epoch
    # exactly what dataloader_drop_last gives (the short windows' zero counts change no weight)
    assert torch.equal(flat_params(static.model), flat_params(dropped.model))
    kept = _trainer(tmp_path, "kept")
    kept.fit()
    assert not torch.equal(flat_params(static.model), flat_params(kept.model))  # the 4 samples did train there


def test_a_short_window_counts_zero_items_for_its_missing_micro_batches(tmp_path):
    full, half = {"x": torch.randn(8, 8), "y": torch.randn(8)}, {"x": torch.randn(4, 8), "y": torch.randn(4)}
    static = _trainer(tmp_path, "static", StaticShapes, gradient_accumulation_steps=3)
    weights = train_step_of(static).loss_weights([full])
    assert [int(c) for c in weights.counts] == [8, 0, 0] and float(weights.weight(0)) == 1.0
    weights = train_step_of(static).loss_weights([full, half])
    assert [int(c) for c in weights.counts] == [8, 4, 0]
    assert [float(weights.weight(i)) for i in (0, 1)] == pytest.approx([8 / 12, 4 / 12])
    # without static shapes a lone micro-batch needs no weight, and a window is only as long as it is
    plain = _trainer(tmp_path, "plain", gradient_accumulation_steps=3)
    assert train_step_of(plain).loss_weights([full]) is None
    assert [int(c) for c in train_step_of(plain).loss_weights([full, half]).counts] == [8, 4]


def test_a_strategy_without_static_shapes_keeps_the_short_last_batch(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.engine.data.static_shapes"):
        trainer = _trainer(tmp_path, "plain")
        loader = trainer.get_train_dataloader()
    assert len(loader) == 8 and not loader.drop_last and not caplog.records
