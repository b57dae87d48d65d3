"""No host synchronisation between logging steps: kiln's own code reads no device value back to
the host (`.item()`, `float(t)`, `bool(t)`, `.cpu()`, `.tolist()`, `.numpy()`) on steps that do not
log, save or evaluate. On CPU this counts calls made from files under kiln/ (torch's own internals,
e.g. the optimizer's step counter, are not kiln's to change); under CUDA,
`torch.cuda.set_sync_debug_mode("error")` checks the same with the driver."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import kiln
from kiln import Callback, Trainer
from tests.helpers import TinyRegressor, TokenModel, base_config, padded_token_data, regression_data

KILN_DIR = os.path.dirname(os.path.abspath(kiln.__file__))
#: host-side data preparation (samplers shuffle with a CPU generator once per epoch) is not a device read
HOST_DATA_DIR = os.path.join(KILN_DIR, "engine", "data")
SYNC_POINTS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class SyncCounter(Callback):
    """Counts host reads issued from kiln's files, per optimizer step (between on_step_begin and the
    next step's begin, i.e. including the step's log/save/eval work)."""

    def __init__(self) -> None:
        self.per_step: dict[int, list[str]] = {}
        self.step = 0

    def on_step_begin(self, config, state, control, **kw):
        self.step = state.global_step + 1

    def record(self, name: str) -> None:
        frame = sys._getframe(2)
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(KILN_DIR) and not path.startswith(HOST_DATA_DIR):
            where = f"{os.path.relpath(frame.f_code.co_filename, KILN_DIR)}:{frame.f_lineno} {name}"
            self.per_step.setdefault(self.step, []).append(where)


@pytest.fixture
def counter(monkeypatch):
    c = SyncCounter()
    for name in SYNC_POINTS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, __original=original, __name=name, **kwargs):
            c.record(__name)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return c


@pytest.mark.parametrize(
    "precision, accumulation, model, preemption",
    [
        ("fp32", 1, "regressor", False),
        ("fp32", 3, "tokens", False),
        ("bf16", 2, "tokens", False),
        ("fp32", 1, "regressor", True),
    ],
)  # save.on_preemption: one process has no flag to agree on, so no read
def test_no_host_reads_between_logging_steps(tmp_path, counter, precision, accumulation, model, preemption):
    log_every = 5
    net, data = (
        (TinyRegressor(), regression_data(64)) if model == "regressor" else (TokenModel(), padded_token_data(64))
    )
    cfg = base_config(
        tmp_path,
        max_steps=12,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=1.0,
        precision=precision,
        log={"history": [], "disable_tqdm": True, "steps": log_every},
        save={"strategy": "steps", "steps": 6, "on_preemption": preemption},
    )
    trainer = Trainer(net, cfg, train_dataset=data, callbacks=[counter])
    trainer.fit()
    busy = {s for s in range(1, 13) if s % log_every == 0 or s % 6 == 0 or s == 12}  # log, save, the end
    quiet = {s: counter.per_step.get(s, []) for s in range(1, 13) if s not in busy}
    assert all(not reads for reads in quiet.values()), f"host reads on non-logging steps: {quiet}"
    assert any(counter.per_step.get(s) for s in busy), "the counter saw nothing at all: it is not wired up"


@pytest.mark.parametrize("limit, reads", [(4, {4, 8, 12}), (0, {12})])
def test_the_nonfinite_guard_reads_once_per_limit_steps_at_most(tmp_path, counter, limit, reads):
    """Between logs the guard reads the losses where a run of `max_nonfinite_steps` nan steps could end:
    every `limit` steps while they stay finite (kiln.engine.loop.loss_reads.NonFiniteGuard); off, never."""
    cfg = base_config(
        tmp_path,
        max_steps=12,
        per_device_train_batch_size=4,
        log={"history": [], "disable_tqdm": True, "steps": 50},
        train={"max_nonfinite_steps": limit},
    )
    Trainer(TinyRegressor(), cfg, train_dataset=regression_data(64), callbacks=[counter]).fit()
    assert {s for s, found in counter.per_step.items() if found} == reads  # 12: the end reads the rest


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_device_sync_between_logging_steps_on_cuda(tmp_path, compiled):
    class Guard(Callback):
        def on_step_begin(self, config, state, control, **kw):
            step = state.global_step + 1  # step 1 compiles, and inductor's own autotuning may synchronise
            quiet = step % 5 != 0 and not (compiled and step == 1)
            torch.cuda.set_sync_debug_mode("error" if quiet else "default")

        def on_step_end(self, config, state, control, **kw):
            torch.cuda.set_sync_debug_mode("default")

    cfg = base_config(
        tmp_path,
        max_steps=9,
        per_device_train_batch_size=4,
        max_grad_norm=1.0,
        precision="bf16",
        log={"history": [], "disable_tqdm": True, "steps": 5},
        strategy={"device": "cuda"},
        torch_compile=compiled,
    )
    try:
        Trainer(TinyRegressor(), cfg, train_dataset=regression_data(64), callbacks=[Guard()]).fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
