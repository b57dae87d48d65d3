"""`auto_find_batch_size`: the per-device batch shrinks by 10% steps until the first window and
optimizer step fit; the run then ends exactly where a run configured with that size ends; a
checkpoint's size is reused on resume. Out-of-memory later in training: test_oom_recovery.py."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.engine.loop.batch_size import is_out_of_memory
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, base_config, regression_data


class MemoryBound(TinyRegressor):
    """Runs 'out of memory' (as CUDA reports it) for batches above `limit`; counts forwards."""

    def __init__(self, limit: int, dropout: float = 0.2) -> None:
        super().__init__(dropout=dropout)
        self.limit, self.forwards, self.last_batch = limit, 0, 0

    def training_step(self, batch):
        self.forwards += 1
        self.last_batch = batch["x"].shape[0]
        if batch["x"].shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch)


def _config(tmp_path, name, batch, **extra):
    return base_config(
        tmp_path / name,
        max_steps=6,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        seed=7,
        **extra,
    )


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_found_size_trains_exactly_like_that_size_configured(tmp_path, caplog):
    data = regression_data(n=64)
    torch.manual_seed(0)
    model = MemoryBound(limit=10)
    trainer = Trainer(model, _config(tmp_path, "auto", 16, auto_find_batch_size=True), train_dataset=data)
    out = trainer.fit()
    assert trainer._train_batch_size == 10  # 16 -> 14 -> 12 -> 10 (x0.9, as accelerate)
    assert trainer.state.train_batch_size == 10
    assert trainer.config.data.per_device_train_batch_size == 16  # the run's size; the config stays as given (HF)
    assert "per_device_train_batch_size=16 ran out of memory; trying 14" in caplog.text

    torch.manual_seed(0)
    reference = MemoryBound(limit=10)
    expected = Trainer(reference, _config(tmp_path, "fixed", 10), train_dataset=data).fit()
    assert torch.equal(_params(model), _params(reference))  # search left no trace: weights, optimizer, RNG
    assert out.training_loss == expected.training_loss


def test_the_search_includes_the_optimizer_step(tmp_path):
    """Forward and backward fit at 12, but creating the optimizer's state after a batch of 12 does not."""

    class TightOptimizer(MemoryBound):
        def configure_optimizers(self):
            model = self

            class Picky(torch.optim.AdamW):
                def step(self, closure=None):
                    if model.last_batch > 10:
                        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (optimizer state)")
                    return super().step(closure)

            return Picky(self.parameters(), lr=1e-2)

    trainer = Trainer(
        TightOptimizer(limit=12),
        _config(tmp_path, "opt", 16, auto_find_batch_size=True),
        train_dataset=regression_data(n=64),
    )
    trainer.fit()
    assert trainer._train_batch_size == 10


def test_a_size_that_fits_is_kept_and_checked_once(tmp_path):
    model = MemoryBound(limit=64)
    trainer = Trainer(
        model, _config(tmp_path, "fits", 8, auto_find_batch_size=True), train_dataset=regression_data(n=32)
    )
    trainer.fit()
    assert trainer._train_batch_size == 8
    assert model.forwards == 2 + 6 * 2  # one probe window of 2 micro-batches, then 6 steps of 2


def test_nothing_fits(tmp_path):
    trainer = Trainer(
        MemoryBound(limit=0),
        _config(tmp_path, "none", 4, auto_find_batch_size=True),
        train_dataset=regression_data(n=16),
    )
    with pytest.raises(KilnError, match="even per_device_train_batch_size=1 runs out of memory"):
        trainer.fit()


def test_resume_reuses_the_checkpoints_size(tmp_path):
    data = regression_data(n=64)
    first = Trainer(
        MemoryBound(limit=10),
        _config(tmp_path, "run", 16, auto_find_batch_size=True, save={"strategy": "steps", "steps": 3}),
        train_dataset=data,
    )
    first.fit()
    model = MemoryBound(limit=10)
    resumed = Trainer(
        model,
        _config(tmp_path, "run", 16, auto_find_batch_size=True, save={"strategy": "steps", "steps": 3}),
        train_dataset=data,
    )
    resumed.fit(resume_from_checkpoint=str(tmp_path / "run" / "out" / "checkpoint-3"))
    assert resumed._train_batch_size == 10
    assert model.forwards == 1 + 2 + 2  # steps 4..6 only (step 4 is the epoch's short last window): no search


def test_other_errors_are_not_mistaken_for_out_of_memory(tmp_path):
    class Broken(TinyRegressor):
        def training_step(self, batch):
            raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        Trainer(
            Broken(), _config(tmp_path, "broken", 4, auto_find_batch_size=True), train_dataset=regression_data(n=16)
        ).fit()
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert not is_out_of_memory(RuntimeError("Expected all tensors to be on the same device"))


def test_a_dataloader_given_as_dataset_is_refused(tmp_path):
    loader = torch.utils.data.DataLoader(regression_data(n=16), batch_size=4)
    with pytest.raises(KilnError, match="a DataLoader passed as train_dataset has a fixed batch size"):
        Trainer(TinyRegressor(), _config(tmp_path, "dl", 4, auto_find_batch_size=True), train_dataset=loader).fit()


def test_a_second_train_searches_again_and_builds_its_own_schedule(tmp_path):
    """A second train() (a new run, HF) on a set-up Trainer: the search probes on the existing optimizer without
    a schedule, then the run builds its linear schedule for its own 6 steps, which ends at 0."""
    model = MemoryBound(limit=10)
    trainer = Trainer(
        model,
        _config(tmp_path, "auto", 16, auto_find_batch_size=True, lr_scheduler_type="linear"),
        train_dataset=regression_data(n=64),
    )
    trainer.fit()
    first = trainer.lr_scheduler
    out = trainer.train()
    assert out.global_step == 6 and trainer._train_batch_size == 10
    assert trainer.lr_scheduler is not first and trainer.lr_scheduler.last_epoch == 6
    assert trainer.optimizer.param_groups[0]["lr"] == 0.0
