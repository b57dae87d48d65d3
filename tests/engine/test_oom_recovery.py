"""`auto_find_batch_size` during training: an out-of-memory error in a window drops the window, splits
the same samples into smaller micro-batches (more accumulation) and redoes the step, so the run ends
where a run configured with the smaller micro-batch from the start ends, with the same step count;
checkpoints written afterwards resume with the new sizes; a micro-batch of 1 is a clear error. An
out-of-memory error outside the window (the optimizer step, a callback) restarts training as HF's
Trainer does: test_auto_batch_retry_vs_hf.py."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.engine.loop.oom_recovery import smaller_micro_batch
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data


class OomAt(TinyRegressor):
    """Raises CUDA's out-of-memory error at the listed forward calls (counting from 1, the
    auto_find_batch_size probe included)."""

    def __init__(self, at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.at, self.forwards, self.sizes = set(at), 0, []

    def training_step(self, batch):
        self.forwards += 1
        self.sizes.append(batch["x"].shape[0])
        if self.forwards in self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch)


def _config(tmp_path, name, batch, accumulation, **extra):
    return base_config(
        tmp_path / name,
        max_steps=6,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-2,
        seed=7,
        **extra,
    )


def _train(tmp_path, name, model, batch, accumulation, **extra):
    torch.manual_seed(0)
    model.load_state_dict(_initial.state_dict())
    trainer = Trainer(model, _config(tmp_path, name, batch, accumulation, **extra), train_dataset=regression_data(n=64))
    return trainer, trainer.fit()


torch.manual_seed(0)
_initial = TinyRegressor()  # every run starts from these weights


@pytest.mark.parametrize("batch, accumulation, smaller, more", [(8, 2, 4, 4), (9, 1, 3, 3)])
def test_out_of_memory_mid_window_redoes_the_step_with_smaller_micro_batches(
    tmp_path, caplog, batch, accumulation, smaller, more
):
    # forward 1..k is the probe; the OOM hits step 3's last micro-batch, after its first one's backward
    oom_at = accumulation * 3 + accumulation
    model = OomAt(at=(oom_at,))
    trainer, out = _train(tmp_path, "recovered", model, batch, accumulation, auto_find_batch_size=True)
    assert (trainer._train_batch_size, trainer.run.accumulation) == (smaller, more)
    assert trainer.state.train_batch_size == smaller
    assert (
        f"Out of memory at step 3 with per_device_train_batch_size={batch}: redoing the step with "
        f"per_device_train_batch_size={smaller} and gradient_accumulation_steps={more}" in caplog.text
    )
    assert model.sizes[oom_at] == smaller  # the redo starts right after the failed forward

    reference = OomAt()
    expected_trainer, expected = _train(tmp_path, "smaller", reference, smaller, more)
    assert out.global_step == expected.global_step == 6
    torch.testing.assert_close(flat_params(model), flat_params(reference))
    assert out.training_loss == pytest.approx(expected.training_loss, rel=1e-5)
    assert trainer.state.epoch == pytest.approx(expected_trainer.state.epoch)


def test_a_checkpoint_after_the_change_resumes_with_the_new_sizes(tmp_path):
    save = {"strategy": "steps", "steps": 4}
    model = OomAt(at=(2 * 3 + 2,))  # step 3 runs out of memory at 8 x 2
    _train(tmp_path, "run", model, 8, 2, auto_find_batch_size=True, save=save)

    resumed_model = OomAt()
    torch.manual_seed(0)
    resumed = Trainer(
        resumed_model,
        _config(tmp_path, "run", 8, 2, auto_find_batch_size=True, save=save),
        train_dataset=regression_data(n=64),
    )
    resumed.fit(resume_from_checkpoint=str(tmp_path / "run" / "out" / "checkpoint-4"))
    assert (resumed._train_batch_size, resumed.run.accumulation) == (4, 4)
    assert resumed_model.sizes == [4] * 8  # steps 5 and 6 only, 4 micro-batches of 4 each: no search, no replay
    torch.testing.assert_close(flat_params(resumed_model), flat_params(model), rtol=0, atol=0)


def test_a_micro_batch_of_one_cannot_be_halved(tmp_path):
    model = OomAt(at=(2, 3))  # the first step fails at 2, then again at 1
    with pytest.raises(KilnError, match="per_device_train_batch_size=1, which cannot be halved further"):
        _train(tmp_path, "one", model, 2, 1, auto_find_batch_size=True)
    assert model.sizes == [2, 2, 1]


def test_a_loader_that_ignores_the_new_size_is_one_sentence(tmp_path):
    class FixedLoader(Trainer):
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=8)

    cfg = _config(tmp_path, "fixed", 8, 2, auto_find_batch_size=True)
    trainer = FixedLoader(OomAt(at=(4,)), cfg, train_dataset=regression_data(n=64))
    with pytest.raises(
        KilnError,
        match="get_train_dataloader\\(\\) still returns batches of 8 after per_device_train_batch_size was set to 4",
    ):
        trainer.fit()


@pytest.mark.parametrize(
    "size, accumulation, expected", [(8, 2, 4), (10, 1, 5), (9, 1, 3), (9, 2, 3), (7, 1, 1), (2, 3, 1)]
)
def test_the_smaller_micro_batch_divides_the_window(size, accumulation, expected):
    assert smaller_micro_batch(size, accumulation) == expected
