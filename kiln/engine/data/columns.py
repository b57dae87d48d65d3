"""HF's `remove_unused_columns`: the data an HF-contract model is fed keeps only what its `forward` takes.

HF's rule (`Trainer._set_signature_columns_if_needed`): the names of `model.forward`'s parameters (a PEFT
model's base model is inspected), plus `label`, `label_ids` and the label names (the default collator turns
`label`/`label_ids` into `labels`). A `datasets.Dataset` loses the other columns before the loader is built
(`remove_columns`, so they are never read or collated, and `group_by_length` sees the remaining columns
only); any other dataset keeps its items, and the collator drops the other keys of each item first
(`RemoveColumnsCollator`), so strings or ragged extras never reach the collator. Two differences, where
HF would feed the model nothing: a forward that takes nothing but `**kwargs` keeps every column, and an
item none of whose keys forward takes is passed whole (HF collates empty dicts)."""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kiln.engine.data.collator import default_data_collator
from kiln.utils.errors import KilnError

log = logging.getLogger(__name__)


def _inspected(model: Any) -> Any:
    """The model whose forward names the columns: a PEFT model's base model, as HF inspects it."""
    if "peft" in sys.modules:  # a PEFT model cannot exist without the package imported
        from peft import PeftMixedModel, PeftModel

        if isinstance(model, PeftModel):
            return model.get_base_model()
        if isinstance(model, PeftMixedModel):
            return model.base_model.model
    return model


def signature_columns(model: Any, label_names: Sequence[str]) -> list[str] | None:
    """The columns HF keeps for `model`, in HF's order; None when `forward` takes only `**kwargs`
    (or has no signature), which keeps every column."""
    try:
        params = inspect.signature(_inspected(model).forward).parameters
    except (TypeError, ValueError):
        return None
    named = [name for name, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if not named:
        return None
    return list(params) + sorted(set(["label", "label_ids", *label_names]))


class RemoveColumnsCollator:
    """Drops the keys of each item that `forward` does not take, then calls the wrapped collator (HF's class
    of the same name; the note about what was dropped is logged once)."""

    def __init__(
        self,
        data_collator: Callable[[list[Any]], Any],
        columns: Sequence[str],
        model_name: str = "",
        description: str = "",
    ) -> None:
        self.data_collator = data_collator
        self.signature_columns = list(columns)
        self._keep = frozenset(columns)
        self.model_name, self.description = model_name, description
        self.message_logged = False

    def _remove_columns(self, feature: Any) -> Any:
        if not isinstance(feature, dict):  # HF leaves anything but dicts alone (tuples, BatchEncoding)
            return feature
        kept = {k: v for k, v in feature.items() if k in self._keep}
        if not kept:  # HF would collate empty dicts: such items are not HF-model inputs at all, so pass them whole
            return feature
        if not self.message_logged:
            _note_ignored(set(feature) - self._keep, self.model_name, self.description)
            self.message_logged = True
        return kept

    def __call__(self, features: list[Any]) -> Any:
        # The usual batch holds nothing forward does not take: a C-level subset test of a dict's keys (anything
        # else gives False or TypeError and takes the per-item path, which leaves non-dicts alone). kiln's own
        # collator, like torch's default_collate, reads every item by the first item's keys, so a key that only a
        # later item has never reaches the batch: there the first item decides, one test a batch instead of one
        # per item, each of which builds a set (about 1 % of a tiny model's instructions a step; see
        # docs/benchmarks.md). HF's note about the dropped columns is about the first item too.
        try:
            if self.data_collator is default_data_collator:
                if features and self._keep.issuperset(features[0]):
                    return self.data_collator(features)
            elif all(map(self._keep.issuperset, features)):
                return self.data_collator(features)
        except TypeError:
            pass
        return self.data_collator([self._remove_columns(f) for f in features])


def _note_ignored(ignored: set[str], model_name: str, description: str) -> None:
    if ignored:
        where = f" in the {description} set" if description else ""
        log.info(
            "The following columns%s don't have a corresponding argument in `%s.forward` and have been ignored: %s.",
            where,
            model_name,
            ", ".join(sorted(ignored)),
        )


def is_datasets_dataset(dataset: Any) -> bool:
    """A `datasets.Dataset` (map-style, with columns), without importing `datasets` when it is not in use."""
    if "datasets" not in sys.modules:
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


def without_unused_columns(
    dataset: Any,
    collator: Callable[[list[Any]], Any] | None,
    model: Any,
    label_names: Sequence[str],
    description: str,
    default_collator: Callable[[list[Any]], Any],
) -> tuple[Any, Callable[[list[Any]], Any] | None]:
    """(dataset, collator) as HF's `_get_dataloader` builds them with `remove_unused_columns`: a
    `datasets.Dataset` without the unused columns, or the collator (the default one when None) wrapped in a
    RemoveColumnsCollator. Raises KilnError when no column of a `datasets.Dataset` is one forward takes."""
    columns = signature_columns(model, label_names)
    if columns is None:
        return dataset, collator
    name = type(_inspected(model)).__name__
    if is_datasets_dataset(dataset):
        ignored = [c for c in dataset.column_names if c not in columns]
        if not ignored:
            return dataset, collator
        if len(ignored) == len(dataset.column_names):
            raise KilnError(
                f"No column of the {description.lower()} dataset ({', '.join(dataset.column_names)}) is an argument of "
                f"{name}.forward ({', '.join(columns)}): rename the columns to the model's inputs, or set "
                "data.remove_unused_columns=false to pass them all."
            )
        _note_ignored(set(ignored), name, description.lower())
        return dataset.remove_columns(ignored), collator
    return dataset, RemoveColumnsCollator(collator or default_collator, columns, name, description.lower())
