"""HF's `_eval_dataloaders`: with `dataloader_persistent_workers` the eval loader is built once and reused
(by dataset name, "eval" for the Trainer's own or a passed dataset), so its workers are not started again
for every evaluation; without it every call builds a new one. kiln reuses a loader only while its key still
means the same dataset (HF would hand back an earlier dataset's loader). And with worker processes
`loader.dataset` is the user's dataset, as in HF, not kiln's per-sample seeding wrapper."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from tests.engine.hf_compare import gpt2, hf_args, kiln_config, token_rows

transformers = pytest.importorskip("transformers")


def _rows(n: int = 6, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    cols = token_rows(n, seed)
    return [
        {"input_ids": torch.tensor(cols["input_ids"][i]), "labels": torch.tensor(cols["labels"][i])} for i in range(n)
    ]


def _both(tmp_path, persistent: bool, workers: int = 1, **data):
    kw = dict(dataloader_num_workers=workers, dataloader_persistent_workers=persistent)
    hf = transformers.Trainer(model=gpt2(), args=hf_args(str(tmp_path / "hf"), **kw), **data)
    ours = Trainer(gpt2(), kiln_config(tmp_path, **kw), **data)
    return hf, ours


@pytest.mark.parametrize("persistent", [True, False])
def test_eval_loader_is_reused_exactly_when_hf_reuses_it(tmp_path, persistent):
    own, other = _rows(), _rows(seed=2)
    hf, ours = _both(tmp_path, persistent, train_dataset=own, eval_dataset={"a": own, "b": other})
    for trainer in (hf, ours):
        assert (trainer.get_eval_dataloader("a") is trainer.get_eval_dataloader("a")) is persistent
        assert (trainer.get_eval_dataloader(own) is trainer.get_eval_dataloader(own)) is persistent
        assert trainer.get_eval_dataloader("a") is not trainer.get_eval_dataloader("b")
    assert (
        set(ours._eval_dataloaders)
        == set(getattr(hf, "_eval_dataloaders", {}))
        == ({"a", "b", "eval"} if persistent else set())
    )


def test_a_cached_key_is_rebuilt_for_another_dataset(tmp_path):
    """HF returns the loader of `first` for `second` here; kiln builds one over `second`."""
    first, second = _rows(), _rows(seed=2)
    ours = Trainer(gpt2(), kiln_config(tmp_path, dataloader_num_workers=1, dataloader_persistent_workers=True))
    a = ours.get_eval_dataloader(first)
    b = ours.get_eval_dataloader(second)
    assert a.dataset is first and b.dataset is second and b is not a
    assert ours.get_eval_dataloader(second) is b  # the new one is the one reused now
    ours.eval_dataset = first
    assert ours.get_eval_dataloader() is not b and ours.get_eval_dataloader().dataset is first


def test_loaders_with_workers_show_the_users_dataset(tmp_path):
    data, held_out = _rows(), _rows(seed=2)
    hf, ours = _both(tmp_path, False, workers=2, train_dataset=data, eval_dataset=held_out)
    for trainer in (hf, ours):
        assert trainer.get_train_dataloader().dataset is data
        assert trainer.get_eval_dataloader().dataset is held_out
        assert trainer.get_test_dataloader(held_out).dataset is held_out
    batch = next(iter(ours.get_train_dataloader()))  # fetched by a worker, through kiln's seeding
    assert batch["input_ids"].shape == (2, 8)


def test_a_new_run_builds_its_own_eval_loaders(tmp_path):
    """The reused eval loaders belong to the run (kiln.engine.run.Run): a second fit() is a new run, so its
    evaluation runs over a loader built with the data as it is now (here a collator changed in between), not
    over the first fit's loader. A model assigned to `trainer.model` starts a new run too."""
    from kiln.engine.data.collator import default_data_collator

    calls: list[tuple[str, int]] = []

    def collator(name):
        return lambda rows: (calls.append((name, len(rows))), default_data_collator(rows))[1]

    rows = _rows()
    config = kiln_config(
        tmp_path,
        dataloader_persistent_workers=True,  # reuse without worker processes (workers=0)
        max_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=3,  # eval batches of 3 rows, training's of 2
        remove_unused_columns=False,
    )
    ours = Trainer(gpt2(), config, train_dataset=rows, eval_dataset=rows, data_collator=collator("first"))
    ours.train()
    first = ours.get_eval_dataloader()
    assert ("first", 3) in calls and ours.get_eval_dataloader() is first  # reused within the run
    calls.clear()
    ours.data_collator = collator("second")
    ours.train()
    assert ("second", 3) in calls and ("first", 3) not in calls
    second = ours.get_eval_dataloader()
    assert second is not first
    ours.model = gpt2()
    assert ours.get_eval_dataloader() is not second
