"""RemoveColumnsCollator (HF's `remove_unused_columns` for data that is not a `datasets.Dataset`): what reaches the
batch is what forward takes, whether the unused keys are in the first item or only in a later one; kiln's own
collator is checked on the first item only (it reads every item by the first item's keys), a user's collator
never sees an unused key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.engine.data.collator import default_data_collator
from kiln.engine.data.columns import RemoveColumnsCollator

KEEP = ["x", "labels"]


def _item(i: int, **extra: Any) -> dict[str, Any]:
    return {"x": torch.full((3,), float(i)), "labels": torch.tensor(i), **extra}


def _expected(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([f["x"] for f in features]), "labels": torch.stack([f["labels"] for f in features])}


def _same(batch: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(batch) == list(expected)
    for key in expected:
        assert torch.equal(batch[key], expected[key])


@pytest.mark.parametrize("where", ["first", "later", "every"])
def test_unused_keys_never_reach_the_batch_of_kilns_collator(where: str) -> None:
    extra = {"first": {0}, "later": {2}, "every": {0, 1, 2, 3}}[where]
    features = [_item(i, idx=i, text=f"row {i}") if i in extra else _item(i) for i in range(4)]
    collate = RemoveColumnsCollator(default_data_collator, KEEP, "Model")
    _same(collate(features), _expected(features))
    assert [i for i, f in enumerate(features) if "idx" in f] == sorted(extra)  # the user's items are left as they were


def test_kilns_collator_checks_only_the_first_item(monkeypatch: pytest.MonkeyPatch) -> None:
    collate = RemoveColumnsCollator(default_data_collator, KEEP, "Model")
    removed: list[Any] = []
    remove = collate._remove_columns
    monkeypatch.setattr(collate, "_remove_columns", lambda f: removed.append(f) or remove(f))
    features = [_item(i) for i in range(4)] + [_item(4, idx=4)]
    _same(collate(features), _expected(features))  # the later `idx` is not in the first item's keys
    assert removed == []
    collate([_item(0, idx=0), _item(1)])
    assert len(removed) == 2  # an unused key in the first item: every item goes through the removal


def test_a_users_collator_sees_only_the_keys_forward_takes() -> None:
    seen: list[set[str]] = []

    def user_collator(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seen.extend(set(f) for f in features)
        return _expected(features)

    features = [_item(0), _item(1), _item(2, idx=2)]  # only a later item has the unused key
    _same(RemoveColumnsCollator(user_collator, KEEP, "Model")(features), _expected(features))
    assert seen == [{"x", "labels"}] * 3


def test_items_that_are_not_dicts_are_left_alone() -> None:
    pairs = [(torch.tensor([1.0]), torch.tensor(0)), (torch.tensor([2.0]), torch.tensor(1))]
    x, y = RemoveColumnsCollator(default_data_collator, KEEP, "Model")(pairs)
    assert torch.equal(x, torch.tensor([[1.0], [2.0]])) and torch.equal(y, torch.tensor([0, 1]))


def test_the_dropped_columns_are_named_once(caplog: pytest.LogCaptureFixture) -> None:
    collate = RemoveColumnsCollator(default_data_collator, KEEP, "Model", "training")
    with caplog.at_level("INFO", logger="kiln.engine.data.columns"):
        collate([_item(0, text="a", idx=0), _item(1, text="b", idx=1)])
        collate([_item(2, text="c", idx=2)])
    notes = [r.getMessage() for r in caplog.records if "have been ignored" in r.getMessage()]
    assert notes == [
        "The following columns in the training set don't have a corresponding argument in `Model.forward` "
        "and have been ignored: idx, text."
    ]
