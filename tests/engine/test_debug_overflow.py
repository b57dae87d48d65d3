"""`debug: underflow_overflow`: kiln's DebugUnderflowOverflow finds an injected fp16 overflow at the
same batch and module as transformers' own class, prints the same report, and stops training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kiln.engine.callbacks.debug_overflow import DebugUnderflowOverflow, OverflowDetected

hf_debug = pytest.importorskip("transformers.debug_utils")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.act(self.inp(x)))


def fp16_net() -> nn.Module:
    torch.manual_seed(0)
    return Net().half()


def batches() -> list[torch.Tensor]:
    """Three normal batches, then one whose first-layer outputs (~1e4) times the blown-up weights
    (see `run`) pass fp16's largest value, 65504."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 4, generator=g).half() for _ in range(4)]
    xs[3] = xs[3] * 1e4
    return xs


def run(debugger_cls, model, capsys, **kwargs):  # type: ignore[no-untyped-def]
    debugger = debugger_cls(model, **kwargs)
    error = None
    try:
        for i, x in enumerate(batches()):
            if i == 3:  # a diverged update: the middle layer's weights grow 100-fold
                with torch.no_grad():
                    model.block[0].weight.mul_(100)
            model(x)
    except Exception as err:  # HF raises ValueError, kiln OverflowDetected
        error = err
    return debugger, error, capsys.readouterr().out


def test_detects_the_injected_overflow_where_hf_does(capsys):
    model = fp16_net()
    hf, hf_err, hf_out = run(hf_debug.DebugUnderflowOverflow, copy.deepcopy(model), capsys)
    ours, our_err, our_out = run(DebugUnderflowOverflow, model, capsys)
    assert isinstance(hf_err, ValueError) and isinstance(our_err, OverflowDetected)
    assert ours.batch_number == hf.batch_number == 3
    assert "Detected inf/nan during batch_number=3" in our_out and "has infs" in our_out
    assert our_out == hf_out  # the same frames, line for line
    assert str(our_err) == (
        "debug underflow_overflow: inf/nan in block.0 (Linear) during batch 3; the frames printed "
        "above show where the values grew."
    )


def test_keeps_only_the_last_frames(capsys):
    model = fp16_net()
    _, _, hf_out = run(hf_debug.DebugUnderflowOverflow, copy.deepcopy(model), capsys, max_frames_to_save=2)
    _, _, our_out = run(DebugUnderflowOverflow, model, capsys, max_frames_to_save=2)
    assert our_out == hf_out and "Last 2 forward frames:" in our_out


def test_trace_batch_nums_and_abort_after_batch_num_match_hf(capsys):
    model = fp16_net()
    options = dict(trace_batch_nums=[1], abort_after_batch_num=1)
    _, hf_err, hf_out = run(hf_debug.DebugUnderflowOverflow, copy.deepcopy(model), capsys, **options)
    ours, our_err, our_out = run(DebugUnderflowOverflow, model, capsys, **options)
    assert our_out == hf_out and "*** Starting batch number=1 ***" in our_out
    assert ours.batch_number == 2 and "abort_after_batch_num=1" in str(our_err) and "aborting" in str(hf_err)


def test_no_report_without_overflow_and_hooks_come_off(capsys):
    model = fp16_net()
    debugger = DebugUnderflowOverflow(model)
    for x in batches()[:3]:
        model(x)
    assert debugger.batch_number == 3 and capsys.readouterr().out == ""
    debugger.detach()
    model(batches()[3])  # overflows, but nothing watches any more
    assert debugger.batch_number == 3


def test_trainer_debug_option_stops_training_at_the_overflow(tmp_path, capsys):
    from kiln import Trainer, TrainingModule

    class Blows(TrainingModule):
        """An fp32 regressor whose input layer overflows on the third batch."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)
            nn.init.constant_(self.lin.weight, 2.0)  # 2 x 2 x 3e38 > float32's largest value

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).squeeze(-1)

        def training_step(self, batch: dict) -> torch.Tensor:
            return ((self(batch["x"]) - batch["y"]) ** 2).mean()

    data = [{"x": torch.full((2,), 3e38 if i == 2 else 1.0), "y": torch.tensor(0.0)} for i in range(4)]
    cfg = {
        "output_dir": str(tmp_path),
        "debug": "underflow_overflow",
        "per_device_train_batch_size": 1,
        "max_steps": 4,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True},
        "data": {"dataloader_drop_last": False},
        "strategy": {"name": "single", "device": "cpu"},
    }
    trainer = Trainer(Blows(), {**cfg, "data_seed": 0}, train_dataset=data)
    trainer.train_dataset = torch.utils.data.DataLoader(data, batch_size=1)  # in order: batch 2 overflows
    with pytest.raises(OverflowDetected, match="inf/nan in lin .Linear. during batch 2"):
        trainer.fit()
    assert "Detected inf/nan during batch_number=2" in capsys.readouterr().out
    assert trainer.state.global_step == 2
