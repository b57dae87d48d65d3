"""data.packing in a whole fit: the Trainer's training loader packs, and every step's update is the one a
hand-written loop computes from the same examples unpacked (each a padded row of its own, the loss divided
by the step's real targets); a run stopped mid-epoch and resumed ends with the uninterrupted run's weights,
over a map-style dataset (kiln's sampler over rows) and over a stream (PackedStream's saved position)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import IterableDataset

from kiln import Trainer
from kiln.engine.data.packing.collator import PackingCollator
from tests.engine.packing import tiny
from tests.helpers import base_config, flat_params

pytest.importorskip("transformers")

LR = 0.1


def config(tmp_path, name="run", **overrides):
    packing = overrides.pop("packing", {"strategy": "bfd", "max_length": 24})
    return base_config(
        tmp_path,
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0,
        data={"packing": packing},
        **overrides,
    )


class Stream(IterableDataset):
    """The examples as a stream without a length or a state of its own."""

    def __init__(self, examples):
        self.examples = examples

    def __iter__(self):
        return iter(self.examples)


def pieces_of(batch):
    """Every piece of a packed batch (its rows' examples and padding) as an example: input_ids and labels."""
    cu = batch["cu_seq_lens_q"].tolist()
    ids, labels = batch["input_ids"].flatten(), batch["labels"].flatten()
    return [{"input_ids": ids[s:e].tolist(), "labels": labels[s:e].tolist()} for s, e in zip(cu[:-1], cu[1:])]


def test_each_step_equals_the_unpacked_step_on_the_same_examples(tmp_path, monkeypatch):
    seen = []
    collate = PackingCollator.__call__
    monkeypatch.setattr(PackingCollator, "__call__", lambda self, items: seen.append(collate(self, items)) or seen[-1])
    model = tiny.model("llama")
    reference = copy.deepcopy(model)
    examples = tiny.examples("llama", n=16)
    trainer = Trainer(model, config(tmp_path, max_steps=3), train_dataset=examples)
    trainer.fit()
    assert len(seen) == 3 and all(b["input_ids"].shape[0] == 2 for b in seen)
    assert len({p for b in seen for p in b["position_ids"].flatten().tolist()}) > 1
    for batch in seen:  # the hand-written loop: each piece alone, the sum of its token losses over the step's items
        padded = tiny.padded_batch(pieces_of(batch))
        items = int(batch["labels"].ne(-100).sum())
        assert items == int(padded["labels"][:, 1:].ne(-100).sum())  # no piece's first token is a target
        reference(**padded, num_items_in_batch=items).loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= LR * p.grad
                p.grad = None
    torch.testing.assert_close(flat_params(trainer.model), flat_params(reference), atol=1e-5, rtol=0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_run_resumed_mid_epoch_ends_like_an_uninterrupted_one(tmp_path, stream):
    examples = tiny.examples("qwen2", n=30)
    data = (lambda: Stream(examples)) if stream else (lambda: examples)

    def fit(name, steps, resume=False):
        cfg = config(tmp_path, name, max_steps=steps, save={"strategy": "steps", "steps": 2})
        trainer = Trainer(tiny.model("qwen2"), cfg, train_dataset=data())
        trainer.fit(resume_from_checkpoint=True if resume else None)
        return trainer

    whole = fit("whole", 4)
    assert whole.state.global_step == 4 and whole.state.epoch_index == 0  # the stop at step 2 is mid-epoch
    fit("parts", 2)
    resumed = fit("parts", 4, resume=True)
    assert resumed.state.global_step == 4
    assert torch.equal(flat_params(resumed.model), flat_params(whole.model))
