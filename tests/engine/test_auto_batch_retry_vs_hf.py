"""`auto_find_batch_size` against transformers.Trainer itself: an out-of-memory error raised outside a
window's forward and backward (here by a callback at `on_step_end`, as in HF's own test
`test_auto_batch_size_with_resume_from_checkpoint`) restarts training from step 0 with the batch size
times 0.9, from the weights and optimizer state the failed attempt left. Same batch-size sequence,
same weights, and a resumed run takes the size the restarted run saved. Also: the optimizer step's
out-of-memory error restarts too, an evaluation's does not, and a resumed run reports instead."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import Trainer
from kiln.engine.callbacks.base import Callback
from kiln.engine.loop.batch_size import evaluation_out_of_memory
from kiln.utils.errors import KilnError
from tests.helpers import flat_params, regression_data

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _reference_skips_gc(monkeypatch):
    """accelerate frees device memory with gc.collect() (9 times per reference run here, each seconds long
    in a test process that has imported Transformers): on CPU it changes nothing HF computes, so the
    reference run skips it (suite time). kiln's own runs are left as they are."""
    import accelerate.utils.memory

    monkeypatch.setattr(accelerate.utils.memory, "gc", types.SimpleNamespace(collect=lambda *args: 0))


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels)}


def _rows(n: int = 64) -> list[dict[str, torch.Tensor]]:
    return [{"x": d["x"], "labels": d["y"]} for d in regression_data(n)]


class _OomAbove:
    """HF's MockCudaOOMCallback: 'CUDA out of memory.' at on_step_end while the batch is 16 or more;
    records (step, batch size) at every step's start."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def on_step_begin(self, args, state, control, **kw):
        self.steps.append((state.global_step, state.train_batch_size))

    def on_step_end(self, args, state, control, **kw):
        if state.train_batch_size >= 16:
            raise RuntimeError("CUDA out of memory.")


class HFOom(_OomAbove, transformers.TrainerCallback):
    pass


class KilnOom(_OomAbove, Callback):
    pass


class _HFInOrder(transformers.Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


class _KilnInOrder(Trainer):
    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=self._train_batch_size, shuffle=False)


SETTINGS = dict(
    max_steps=2,
    per_device_train_batch_size=16,
    auto_find_batch_size=True,
    learning_rate=1e-2,
    optim="adamw_torch",
    save_strategy="steps",
    save_steps=1,
    seed=0,
)


def _hf(out, model, callbacks=(), **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out), use_cpu=True, report_to=[], disable_tqdm=True, **SETTINGS
    )
    return _HFInOrder(model=model, args=args, train_dataset=_rows(), callbacks=list(callbacks), **kw)


def _kiln(out, model, callbacks=(), **kw):
    cfg = {
        "output_dir": str(out),
        "strategy": {"device": "cpu"},
        "log": {"history": [], "disable_tqdm": True},
        **{**SETTINGS, **kw.pop("settings", {})},
    }
    return _KilnInOrder(model, cfg, train_dataset=_rows(), callbacks=list(callbacks), **kw)


def test_an_out_of_memory_error_at_step_end_restarts_smaller_as_hf_does(tmp_path, caplog):
    torch.manual_seed(0)
    start = Lin()
    hf_model, kiln_model = copy.deepcopy(start), copy.deepcopy(start)
    hf_cb, kiln_cb = HFOom(), KilnOom()
    hf = _hf(tmp_path / "hf", hf_model, [hf_cb])
    hf.train()
    ours = _kiln(tmp_path / "kiln", kiln_model, [kiln_cb])
    ours.fit()

    assert hf_cb.steps == [
        (0, 16),
        (0, 14),
        (1, 14),
    ]  # step 1 at 16 fails after its update; 16 * 0.9 -> 14, from step 0
    assert kiln_cb.steps == hf_cb.steps
    assert ours._train_batch_size == hf._train_batch_size == 14
    assert ours.state.global_step == hf.state.global_step == 2
    assert ours.state.train_batch_size == 14
    assert "training restarts from step 0 with per_device_train_batch_size=14" in caplog.text
    # the restart keeps the weights and the optimizer state the failed step left, and builds a new schedule
    torch.testing.assert_close(flat_params(kiln_model), flat_params(hf_model), rtol=0, atol=2e-6)

    # a new Trainer resuming the run trains on with the size the restarted run found (HF's test)
    hf_again = _hf(tmp_path / "hf", hf_model)
    assert hf_again._train_batch_size == 16
    hf_again.train(resume_from_checkpoint=True)
    ours_again = _kiln(tmp_path / "kiln", kiln_model)
    assert ours_again._train_batch_size == 16
    ours_again.fit(resume_from_checkpoint=True)
    assert ours_again._train_batch_size == hf_again._train_batch_size == 14


class _Recorder:
    def __init__(self, steps: list) -> None:
        self.steps = steps

    def on_step_begin(self, args, state, control, **kw):
        self.steps.append((state.global_step, state.train_batch_size))


class _Record(_Recorder, Callback):
    pass


class _HFRecord(_Recorder, transformers.TrainerCallback):
    pass


class _EvalOom(Lin):
    def forward(self, x, labels=None):
        if not self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return super().forward(x, labels)


def _picky(model: nn.Module, fail_at: int) -> torch.optim.Optimizer:
    calls = [0]

    class Picky(torch.optim.AdamW):
        def step(self, closure=None):
            calls[0] += 1
            if calls[0] == fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
            return super().step(closure)

    return Picky(model.parameters(), lr=1e-2)


def test_out_of_memory_in_the_optimizer_step_restarts_smaller_as_hf_does(tmp_path, caplog):
    """Step 2's optimizer step fails (kiln's probe steps once before training: its call 3 is HF's call 2).
    Both restart from whatever the weights are, without the failed step's gradients."""
    torch.manual_seed(0)
    start = Lin()
    hf_model, kiln_model = copy.deepcopy(start), copy.deepcopy(start)
    hf_steps: list = []
    hf = _hf(tmp_path / "hf", hf_model, [_HFRecord(hf_steps)], optimizers=(_picky(hf_model, 2), None))
    hf.train()
    steps: list = []
    ours = _kiln(tmp_path / "kiln", kiln_model, [_Record(steps)], optimizers=(_picky(kiln_model, 3), None))
    ours.fit()
    assert steps == hf_steps == [(0, 16), (1, 16), (0, 14), (1, 14)]
    assert ours._train_batch_size == 14 and ours.state.global_step == 2
    assert "out of memory with per_device_train_batch_size=16 after 1 optimizer steps" in caplog.text
    torch.testing.assert_close(flat_params(kiln_model), flat_params(hf_model), rtol=0, atol=2e-6)


def test_a_batch_of_one_that_still_runs_out_of_memory_is_one_sentence(tmp_path):
    with pytest.raises(KilnError, match="out of memory during training even with per_device_train_batch_size=1"):
        _kiln(tmp_path / "one", Lin(), [_AlwaysOom()], settings={"per_device_train_batch_size": 2}).fit()


class _AlwaysOom(Callback):
    def on_step_end(self, args, state, control, **kw):
        raise RuntimeError("CUDA out of memory.")


def test_out_of_memory_in_evaluation_is_reported_not_retried(tmp_path):
    rec: list = []
    trainer = _kiln(
        tmp_path / "eval",
        _EvalOom(),
        [_Record(rec)],
        eval_dataset=_rows(8),
        settings={"eval_strategy": "steps", "eval_steps": 1},
    )
    with pytest.raises(
        KilnError,
        match="Evaluation ran out of memory; auto_find_batch_size only adjusts the training "
        "batch size: lower per_device_eval_batch_size",
    ):
        trainer.fit()
    assert rec == [(0, 16)]  # no restart


def test_only_an_out_of_memory_error_in_evaluation_is_reworded_and_only_with_the_search_on():
    with pytest.raises(ValueError, match="shape"):
        with evaluation_out_of_memory(True):
            raise ValueError("shape mismatch")
    with pytest.raises(torch.OutOfMemoryError):
        with evaluation_out_of_memory(False):
            raise torch.OutOfMemoryError("CUDA out of memory.")


def test_a_resumed_run_reports_the_error_instead_of_restarting(tmp_path):
    _kiln(tmp_path / "run", Lin(), settings={"max_steps": 1}).fit()
    resumed = _kiln(tmp_path / "run", Lin(), [KilnOom()])
    with pytest.raises(KilnError, match="Out of memory during training with per_device_train_batch_size=16"):
        resumed.fit(resume_from_checkpoint=True)
