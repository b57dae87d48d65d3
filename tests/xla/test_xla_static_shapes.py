"""Static shapes on `strategy: xla` (Strategy.static_shapes): a dataset whose length is not a multiple
of the batch size, with an accumulation window cut short at each epoch's end, trains two epochs
without compiling anything after the first steps, and equals the CPU's `single` run with
`dataloader_drop_last` (the documented behaviour: the short last batch is dropped, with one log line)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch_xla")

import torch  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

from kiln import Trainer  # noqa: E402
from kiln.engine.callbacks.base import Callback  # noqa: E402
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data  # noqa: E402

# 60 samples in batches of 8: 7 full batches and 4 samples left over; windows of 2 micro-batches:
# 3 full windows and a short one (1 micro-batch) per epoch, so 4 optimizer steps per epoch
N, BATCH, ACCUMULATE = 60, 8, 2


def _config(tmp_path, name, strategy, **over):
    settings = dict(
        num_train_epochs=2,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-2,
        max_grad_norm=0.5,
    )
    cfg = base_config(tmp_path, strategy={"name": strategy}, **{**settings, **over})
    cfg["output_dir"] = str(tmp_path / name)
    if strategy == "single":
        cfg["strategy"]["device"] = "cpu"
    return cfg


class _Compilations(Callback):
    def __init__(self):
        self.rows = []

    def on_step_end(self, args, state, control, **kw):
        compiles = met.metric_data("CompileTime")
        self.rows.append((state.global_step, state.epoch, compiles[0] if compiles else 0))


def test_short_last_batch_and_window_compile_nothing_new_and_match_the_cpu(tmp_path, caplog):
    met.clear_all()
    seen = _Compilations()
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="kiln.engine.data.static_shapes"):
        xla = Trainer(
            TinyRegressor(), _config(tmp_path, "xla", "xla"), train_dataset=regression_data(n=N), callbacks=[seen]
        )
        out = xla.fit()
    assert "drops 4 sample(s) of each epoch" in caplog.text
    rows = seen.rows
    assert out.global_step == 8 and [r[0] for r in rows] == list(range(1, 9)), rows
    # step 1 compiles the micro-batch graphs and the optimizer's first step (its state is created);
    # from step 2 on every step replays them: the short window (steps 4 and 8) and the second epoch too
    assert rows[0][2] > 0 and len({c for step, _, c in rows if step >= 2}) == 1, rows

    torch.manual_seed(0)
    cpu = Trainer(
        TinyRegressor(),
        _config(tmp_path, "cpu", "single", dataloader_drop_last=True),
        train_dataset=regression_data(n=N),
    )
    out_cpu = cpu.fit()
    assert out_cpu.global_step == 8
    # the same maths on another backend: equal to float32 rounding
    assert torch.allclose(flat_params(xla.model).cpu(), flat_params(cpu.model), atol=1e-6, rtol=1e-5)
    assert out.training_loss == pytest.approx(out_cpu.training_loss, rel=1e-5)


def test_only_a_users_dataloader_with_a_short_batch_is_warned_about(tmp_path, caplog):
    from torch.utils.data import DataLoader

    trainer = Trainer(
        TinyRegressor(),
        _config(tmp_path, "warn", "xla"),
        train_dataset=regression_data(n=N),
        eval_dataset=regression_data(n=12),
    )
    with caplog.at_level(logging.WARNING, logger="kiln.strategies.xla.loader"):
        assert len(trainer.get_eval_dataloader()) == 2  # kiln's evaluation keeps its short batch, silently
        assert not caplog.records
        trainer.strategy.process_dataloader(DataLoader(regression_data(n=12), batch_size=BATCH))
    assert "4 rows instead of 8" in caplog.text and "drop_last=True" in caplog.text
