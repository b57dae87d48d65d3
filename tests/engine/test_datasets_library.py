"""`datasets` (in-memory, no hub) against HF's own Trainer: `remove_unused_columns` drops what the model's
forward does not take (a `datasets.Dataset` loses the columns; any other dataset's items lose the keys before
the collator, HF's RemoveColumnsCollator), `label`/`label_ids` are kept, rows without a format (lists) and
`set_format("torch")` rows both train, and a streaming `datasets.IterableDataset` trains and resumes exactly
from its own `state_dict()`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln import Trainer
from kiln.utils.errors import KilnError
from tests.checkpoint.checkpoint_helpers import Crash, CrashAfterSave
from tests.engine.hf_compare import gpt2, hf_args, kiln_config, losses, max_diff, token_rows

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")


def _fit_both(tmp_path, data, steps: int = 4, collator=None, hf_kw=None, **kw):
    theirs, ours = gpt2(), gpt2()
    hf = transformers.Trainer(
        model=theirs,
        args=hf_args(str(tmp_path / "hf"), max_steps=steps, **(hf_kw or kw)),
        train_dataset=data,
        data_collator=collator,
    )
    hf.train()
    mine = Trainer(ours, kiln_config(tmp_path, max_steps=steps, **kw), train_dataset=data, data_collator=collator)
    mine.fit()
    return hf, mine, max_diff(ours, theirs)


@pytest.mark.parametrize("fmt", [None, "torch"])
def test_a_datasets_dataset_loses_the_columns_forward_does_not_take(tmp_path, fmt):
    data = datasets.Dataset.from_dict(token_rows(16))  # idx and text are not GPT-2 inputs
    if fmt:
        data = data.with_format(fmt, columns=["input_ids", "labels", "idx"], output_all_columns=True)
    hf, mine, diff = _fit_both(tmp_path, data)
    assert diff < 2e-5 and losses(mine) == pytest.approx(losses(hf), rel=1e-5)
    assert mine.get_train_dataloader().dataset.column_names == ["input_ids", "labels"]
    assert data.column_names == ["input_ids", "labels", "idx", "text"]  # the user's dataset is left as it was


def _stacking(features):
    """A collator that stacks every key: it fails on a string, so it only works once `text` is gone."""
    return {k: torch.stack([torch.as_tensor(f[k]) for f in features]) for k in features[0]}


def test_other_datasets_lose_the_keys_before_the_collator(tmp_path):
    cols = token_rows(16)
    rows = [
        {k: (torch.tensor(v[i]) if k in ("input_ids", "labels") else v[i]) for k, v in cols.items()} for i in range(16)
    ]
    hf, mine, diff = _fit_both(tmp_path, rows, collator=_stacking)
    assert diff < 2e-5 and losses(mine) == pytest.approx(losses(hf), rel=1e-5)
    with pytest.raises(TypeError):  # the check above means something: the collator cannot take `text`
        _stacking(rows[:2])
    kept = Trainer(
        gpt2(), kiln_config(tmp_path / "keep", remove_unused_columns=False), train_dataset=rows, data_collator=_stacking
    )
    with pytest.raises(TypeError):
        next(iter(kept.get_train_dataloader()))


class Classifier(nn.Module):
    """forward(input_ids, labels): `label` / `label_ids` columns are kept for it (the collator renames them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(40, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _labelled(label: str):
    cols = token_rows(16)
    return datasets.Dataset.from_dict(
        {"input_ids": cols["input_ids"], label: [i % 3 for i in range(16)], "text": cols["text"]}
    )


@pytest.mark.parametrize("label", ["label", "label_ids"])
def test_label_columns_are_kept_by_hfs_rule(tmp_path, label):
    data = _labelled(label)
    hf = transformers.Trainer(model=Classifier(), args=hf_args(str(tmp_path / "hf")), train_dataset=data)
    mine = Trainer(Classifier(), kiln_config(tmp_path), train_dataset=data)
    expected = hf._remove_unused_columns(data).column_names  # HF's own rule
    assert mine.get_train_dataloader().dataset.column_names == expected == ["input_ids", label]


def test_a_label_column_trains_as_in_hf(tmp_path):
    data = _labelled("label")  # HF's default collator takes `label_ids` as a sequence only
    theirs, ours = Classifier(), Classifier()
    hf = transformers.Trainer(model=theirs, args=hf_args(str(tmp_path / "hf"), max_steps=4), train_dataset=data)
    hf.train()
    mine = Trainer(ours, kiln_config(tmp_path, max_steps=4), train_dataset=data)
    mine.fit()
    assert max_diff(ours, theirs) < 2e-6 and losses(mine) == pytest.approx(losses(hf), rel=1e-5)


def test_no_column_forward_takes_is_one_clear_error(tmp_path):
    data = datasets.Dataset.from_dict({"tokens": [[1, 2]] * 4, "text": ["a"] * 4})
    trainer = Trainer(gpt2(), kiln_config(tmp_path, max_steps=1), train_dataset=data)
    with pytest.raises(KilnError, match="No column of the training dataset .*remove_unused_columns=false"):
        trainer.get_train_dataloader()


def _stream():
    data = datasets.Dataset.from_dict(token_rows(12))  # 6 batches of 2 per pass; idx and text go in the collator
    return data.to_iterable_dataset(num_shards=3).with_format("torch")


def test_a_streaming_dataset_trains_as_in_hf(tmp_path):
    hf, mine, diff = _fit_both(tmp_path, _stream(), steps=9)  # a second pass over the stream from step 7
    # roundoff only (op order differs; it grows with the steps): a batch out of place moves weights ~1e-3
    assert diff < 5e-5 and losses(mine) == pytest.approx(losses(hf), rel=1e-5)


def _fit_stream(out, steps, crash=None, resume=None, model=None):
    callbacks = [CrashAfterSave(crash)] if crash else []
    cfg = kiln_config(out, max_steps=steps, save={"strategy": "steps", "steps": 4})
    trainer = Trainer(model or gpt2(), cfg, train_dataset=_stream(), callbacks=callbacks)
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def test_a_streaming_dataset_resumes_from_its_state_dict_exactly(tmp_path, caplog):
    straight = _fit_stream(tmp_path / "straight", 10)
    with pytest.raises(Crash):
        _fit_stream(tmp_path / "crashed", 10, crash=4)
    fresh = gpt2()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # the resumed run must take the checkpoint's weights
    resumed = _fit_stream(tmp_path / "crashed", 10, resume=True, model=fresh)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(resumed) == losses(straight)
    assert "by iterating over them" not in caplog.text  # restored from state_dict(), not re-read


def test_what_is_dropped_is_logged_once(tmp_path, caplog):
    cols = token_rows(8)
    rows = [{k: v[i] for k, v in cols.items()} for i in range(8)]
    trainer = Trainer(gpt2(), kiln_config(tmp_path), train_dataset=rows, eval_dataset=datasets.Dataset.from_dict(cols))
    with caplog.at_level("INFO", logger="kiln.engine.data.columns"):
        assert [sorted(b) for b in trainer.get_train_dataloader()] == [["input_ids", "labels"]] * 4
        trainer.get_eval_dataloader()
    notes = [r.getMessage() for r in caplog.records if r.name == "kiln.engine.data.columns"]
    assert notes == [
        "The following columns in the training set don't have a corresponding argument in "
        "`GPT2LMHeadModel.forward` and have been ignored: idx, text.",
        "The following columns in the evaluation set don't have a corresponding argument in "
        "`GPT2LMHeadModel.forward` and have been ignored: idx, text.",
    ]


def test_without_datasets_imported_nothing_is_taken_for_a_datasets_dataset(monkeypatch):
    import sys

    from kiln.engine.data.columns import is_datasets_dataset

    assert is_datasets_dataset(datasets.Dataset.from_dict({"a": [1]}))
    monkeypatch.delitem(sys.modules, "datasets")
    assert not is_datasets_dataset([{"a": 1}]) and "datasets" not in sys.modules  # and it was not imported for it
