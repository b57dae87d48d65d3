"""A shuffling DataLoader returned by an overridden `get_train_dataloader` is read as HF's Trainer reads it:
exactly len(loader) batches per epoch. torch's RandomSampler draws one more permutation from the loader's
generator when it is asked past its end (as `for batch in loader` asks), so a loop that asks moves the
next epoch's order; HF never asks. A resume inside or at the end of such an epoch stays exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from kiln import Trainer
from tests.checkpoint.checkpoint_helpers import (
    Crash,
    CrashAfterSave,
    config,
    make_model,
    numeric_history,
    regression_data,
    weights,
)
from tests.engine.hf_compare import gpt2, hf_args, kiln_config, max_diff, token_rows

transformers = pytest.importorskip("transformers")

ROWS = 12  # 6 batches of 2: the last batch is full, so only a request past the end draws from the generator


def _rows() -> list[dict[str, torch.Tensor]]:
    cols = token_rows(ROWS)
    return [
        {"input_ids": torch.tensor(cols["input_ids"][i]), "labels": torch.tensor(cols["labels"][i])}
        for i in range(ROWS)
    ]


def _users_loader(rows: list) -> DataLoader:
    return DataLoader(rows, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))


def test_overridden_loader_trains_on_hfs_batches_over_two_epochs(tmp_path):
    rows, seen = _rows(), {"hf": [], "kiln": []}

    class HF(transformers.Trainer):
        def get_train_dataloader(self):
            return _users_loader(rows)

        def training_step(self, model, inputs, num_items_in_batch=None):
            seen["hf"].append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, num_items_in_batch)

    class Kiln(Trainer):
        def get_train_dataloader(self):
            return _users_loader(rows)

        def training_step(self, model, inputs, num_items_in_batch=None, micro_batch=None):
            seen["kiln"].append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, num_items_in_batch, micro_batch)

    theirs, ours = gpt2(), gpt2()
    # kiln's default optimizer (HF >= 5 on torch >= 2.8 defaults to the fused kernel, whose roundoff differs)
    HF(model=theirs, args=hf_args(str(tmp_path / "hf"), max_steps=10, optim="adamw_torch")).train()
    Kiln(ours, kiln_config(tmp_path, max_steps=10)).fit()
    assert len(seen["kiln"]) == len(seen["hf"]) == 10
    assert all(torch.equal(a, b) for a, b in zip(seen["kiln"], seen["hf"]))  # steps 7-10: the second epoch
    # op order differs: 6e-8 after step 1, which Adam at lr 1e-2 grows to 1e-5..5e-5 by step 10 depending on the
    # CPU's kernels; a batch out of place or a step missed moves the weights by ~1e-2
    assert max_diff(ours, theirs) < 1e-4


def _crash_and_resume(tmp_path, cfg: dict, crash_at: int) -> tuple[Trainer, Trainer]:
    class Kiln(Trainer):
        def get_train_dataloader(self):
            return DataLoader(regression_data(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))

    def run(out, model_seed=0, crash=None, resume=None):
        callbacks = [CrashAfterSave(crash)] if crash else []
        trainer = Kiln(make_model(model_seed), config(str(tmp_path / out), **cfg), callbacks=callbacks)
        trainer.fit(resume_from_checkpoint=resume)
        return trainer

    straight = run("straight")
    with pytest.raises(Crash):
        run("crashed", crash=crash_at)
    return straight, run("crashed", model_seed=1234, resume=True)


@pytest.mark.parametrize("crash_at", [13, 10], ids=["mid-second-epoch", "at-epoch-boundary"])
def test_resume_with_an_overridden_shuffling_loader_is_exact(tmp_path, crash_at):
    # 40 rows in batches of 4: 10 batches per epoch; the boundary case saves at the end of the first epoch
    cfg = {"max_steps": 25, "save_steps": crash_at} if crash_at % 10 else {"max_steps": 25, "save_strategy": "epoch"}
    straight, resumed = _crash_and_resume(tmp_path, cfg, crash_at)
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert numeric_history(resumed) == numeric_history(straight)
