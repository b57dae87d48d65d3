"""A look at the first training item before any model is placed or process group used: items that
the collator or the model cannot take (tuples where mappings are expected) fail with one sentence
saying what the dataset returned and what is needed, instead of a traceback from a worker; and
batches that a TrainingModule's training_step certainly cannot read (it subscripts keys the items
lack, or unpacks dicts), instead of a KeyError from inside the user's code."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kiln.utils.errors import KilnError


def describe(item: Any) -> str:
    """`tuple (tensor[8], tensor[])` style: the type and what it holds, without values."""

    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"tensor{list(x.shape)}"
        return type(x).__name__

    if isinstance(item, (tuple, list)):
        inner = ", ".join(one(x) for x in item[:4]) + (", ..." if len(item) > 4 else "")
        return f"{type(item).__name__} ({inner})"
    return one(item)


def _first_item(dataset: Any) -> Any:
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        if len(dataset) == 0:
            return None
        return dataset[0]
    except Exception:  # noqa: BLE001 - datasets that cannot be indexed are left to the dataloader
        return None


def _collate_quietly(collator: Callable[[list[Any]], Any], item: Any) -> Any:
    """Collate one item without consuming random numbers (masking collators draw them), so the
    probe leaves the run's random streams exactly as they were."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return collator([item])
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def check_training_data(
    dataset: Any, collator: Callable[[list[Any]], Any] | None, module: Any, training_module: bool
) -> None:
    """Both checks below on one read of the first item (reading a sample can be costly, and a resumed
    run must not read more of the data than the batches it trains on)."""
    item = _first_item(dataset)
    check_first_item(dataset, collator, training_module, item=item)
    check_step_input(module, dataset, collator, item=item)


_UNREAD = object()


def check_first_item(
    dataset: Any, collator: Callable[[list[Any]], Any] | None, training_module: bool, item: Any = _UNREAD
) -> None:
    """Raise KilnError if the dataset's items (tuples/lists) cannot become what the model needs."""
    item = _first_item(dataset) if item is _UNREAD else item
    if item is None or isinstance(item, Mapping) or not isinstance(item, Sequence) or isinstance(item, (str, bytes)):
        return
    if collator is None and training_module:
        return  # default_collate keeps the tuple; training_step decides what it accepts
    from kiln.engine.data.collator import default_data_collator

    name = type(collator).__name__ if collator is not None else "the default collator"
    try:
        batch = _collate_quietly(collator or default_data_collator, item)
    except Exception as err:  # noqa: BLE001 - the collator's own error type is unknown
        raise KilnError(
            f"The data collator ({name}) failed on the dataset's items, which are {describe(item)} ({type(err).__name__}: "
            f"{err}): it expects mappings such as {{'input_ids': ..., 'labels': ...}}; return dicts from the dataset's "
            "__getitem__, or pass a data_collator that accepts tuples."
        ) from None
    if not training_module and not isinstance(batch, Mapping):
        raise KilnError(
            f"The dataset's items are {describe(item)}, which {name} turns into a {type(batch).__name__}, but an "
            "HF-contract model is called as model(**batch) and needs a dict: return dicts such as {'input_ids': ..., "
            "'labels': ...} from __getitem__, pass a data_collator that builds one, or wrap the model in a "
            "TrainingModule whose training_step(batch) takes the tuple."
        )


def _step_reads(step: Callable[..., Any]) -> tuple[set[str], int | None] | None:
    """What `training_step(batch)` reads of its batch, from its source: the string keys it subscripts
    (`batch["x"]`) and the length it unpacks it into (`x, y = batch`, -1 with a starred target), or
    None when that cannot be told (no source, the batch rebound, keys tested with `in` / `.get`), so
    that the check only speaks when the step would certainly fail."""
    import ast
    import inspect
    import textwrap

    try:
        name = next(iter(inspect.signature(step).parameters))
        tree = ast.parse(textwrap.dedent(inspect.getsource(step)))
    except (TypeError, ValueError, OSError, SyntaxError, StopIteration):
        return None
    keys: set[str] = set()
    unpacked: int | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return None  # the batch is rebound: what is read later is something else
        if isinstance(node, ast.Compare) and any(isinstance(c, ast.Name) and c.id == name for c in node.comparators):
            return None  # `"labels" in batch`: optional keys
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name:
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                keys.add(node.slice.value)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == name:
            for target in node.targets:
                if isinstance(target, (ast.Tuple, ast.List)):
                    starred = any(isinstance(e, ast.Starred) for e in target.elts)
                    unpacked = -1 if starred else len(target.elts)
    return keys, unpacked


def check_step_input(
    module: Any, dataset: Any, collator: Callable[[list[Any]], Any] | None, item: Any = _UNREAD
) -> None:
    """Raise KilnError when a TrainingModule's training_step would fail on the first batch because
    the data has the wrong shape for it (strings or tuples where it reads keys, a key the items lack,
    dicts where it unpacks a tuple): one sentence about the data, not a KeyError from the user's code."""
    from kiln.engine.model.module import TrainingModule

    if (
        not isinstance(module, TrainingModule)
        or getattr(type(module), "training_step", None) is TrainingModule.training_step
    ):
        return
    step = module.training_step
    from kiln.engine.data.collator import default_data_collator

    if collator is not None and collator is not default_data_collator:
        return  # a user's collator may keep state or count calls: an extra call is not kiln's to make
    item = _first_item(dataset) if item is _UNREAD else item
    reads = _step_reads(step) if item is not None else None
    if reads is None:
        return
    keys, unpacked = reads

    try:
        batch = _collate_quietly(collator or default_data_collator, item)
    except Exception:  # noqa: BLE001 - the loader will report the collator's own failure
        return
    what = f"the dataset's items are {describe(item)}" + (
        f" with keys {sorted(map(str, item))}" if isinstance(item, Mapping) else ""
    )
    step_name = f"{type(module).__name__}.training_step"
    if keys and not isinstance(batch, Mapping):
        key = sorted(keys)[0]
        raise KilnError(
            f"{step_name} reads batch[{key!r}], but {what}, which batch into a {type(batch).__name__}: return "
            f"dicts such as {{{key!r}: ...}} from the dataset's __getitem__, or pass a data_collator that builds them."
        )
    if keys and isinstance(batch, Mapping):
        missing = sorted(k for k in keys if k not in batch)
        if missing:
            raise KilnError(
                f"{step_name} reads batch[{missing[0]!r}], which the batches lack: {what}"
                f"{'' if collator is None else f' (batches: {sorted(map(str, batch))})'}; add {missing[0]!r} "
                "to the items, or pass a data_collator that adds it."
            )
    if unpacked is not None and isinstance(batch, Mapping):
        raise KilnError(
            f"{step_name} unpacks the batch as a sequence, but {what}, which batch into a dict (unpacking "
            "it gives its keys): read batch['key'] in training_step, or return tuples from the dataset."
        )
    if (
        unpacked not in (None, -1)
        and isinstance(batch, Sequence)
        and not isinstance(batch, str)
        and len(batch) != unpacked
    ):
        raise KilnError(
            f"{step_name} unpacks the batch into {unpacked} values, but {what}, which batch into "
            f"{len(batch)}: return {unpacked}-tuples from the dataset, or unpack what it returns."
        )


def check_eval_dataset(dataset: Any, what: str, fix: str) -> None:
    """Raise KilnError when an evaluation dataset with a length has no items: evaluating it would report
    speed metrics and no eval_loss, which reads like a broken model rather than missing data."""
    from kiln.engine.data.loaders import is_sized

    if dataset is None or isinstance(dataset, (Mapping, torch.utils.data.IterableDataset)) or not is_sized(dataset):
        return
    if len(dataset) == 0:
        raise KilnError(f"{what} is empty (0 items), so there would be no eval_loss to report: {fix}.")
