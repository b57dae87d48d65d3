"""`data.packing`: training examples concatenated into rows, each example with its own positions and attention.

Packing is a plug-in at the data edge. `packed_training_data` takes the training dataset and collator the
Trainer would use and returns packed ones (rows from `rows`, batches from `collator`), after checking that
the model can be trained that way (`support`) and installing the pre-hook that turns the batch's example
boundaries into its attention mask (`attention`). What goes into which row is planned by `bins`.
docs/fine-tuning.md says what it changes and what each option costs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import IterableDataset

from kiln.engine.data.packing.attention import PackedAttention, install
from kiln.engine.data.packing.collator import PackingCollator
from kiln.engine.data.packing.examples import ExampleReader
from kiln.engine.data.packing.rows import PackedRows, PackedStream
from kiln.engine.data.packing.support import check_window, inspect_model
from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)

STRATEGIES = ("bfd", "bfd_split", "wrapped")


def packed_training_data(
    dataset: Any,
    collator: Callable[[list[Any]], Any] | None,
    *,
    user_collator: Any,
    model: nn.Module,
    training_module: bool,
    data_cfg: Any,
    strategy: Any,
) -> tuple[Any, Callable]:
    """(dataset, collator) of packed rows for the training loader, or one sentence saying why not."""
    from kiln.engine.data.columns import RemoveColumnsCollator
    from kiln.engine.data.loaders import is_sized

    packing = data_cfg.packing
    _check_settings(packing, data_cfg, user_collator, strategy)
    facts = inspect_model(model, training_module)
    if packing.strategy is not None:
        check_window(facts, packing.max_length)
    keep = frozenset(collator.signature_columns) if isinstance(collator, RemoveColumnsCollator) else None
    reader = ExampleReader(keep)
    if packing.strategy is not None:
        if isinstance(dataset, IterableDataset) or not is_sized(dataset):
            dataset = PackedStream(
                dataset, packing.strategy, packing.max_length, reader, strategy.data_shards, strategy.data_shard_rank
            )
        else:
            examples = len(dataset)
            dataset = PackedRows(dataset, packing.strategy, packing.max_length, reader)
            log.info(
                "data.packing: %d examples in %d rows of at most %d tokens (%s).",
                examples,
                len(dataset),
                packing.max_length,
                packing.strategy,
            )
    padding_free = packing.padding_free if packing.padding_free is not None else facts.attention == "varlen"
    install(model, PackedAttention(facts.attention, facts.causal, facts.window, facts.name))
    return dataset, PackingCollator(
        reader, shifts_labels=facts.shifts_labels, pad_id=facts.pad_id, padding_free=padding_free
    )


def _check_settings(packing: Any, data_cfg: Any, user_collator: Any, strategy: Any) -> None:
    if packing.strategy is not None and packing.strategy not in STRATEGIES:
        raise ConfigError(
            f"data.packing.strategy is {packing.strategy!r}; choose bfd, bfd_split or wrapped (or null: no packing)."
        )
    if not isinstance(packing.max_length, int) or packing.max_length < 1:
        raise ConfigError(
            f"data.packing.max_length is {packing.max_length!r}; give the packed row's length in tokens (>= 1)."
        )
    if user_collator is not None:
        raise ConfigError(
            "data.packing builds the training batches itself (rows with position_ids and the examples' "
            f"boundaries), so the data_collator passed ({type(user_collator).__name__}) would not be used; "
            "pass none (causal LMs get labels from input_ids when the examples have none)."
        )
    if data_cfg.group_by_length:
        raise ConfigError(
            "group_by_length and data.packing both cut padding, and packed rows leave none to group by "
            "length; drop group_by_length."
        )
    if data_cfg.dispatch_batches and strategy.data_shards > 1:
        raise ConfigError(
            "data.packing has each rank pack its own rows, but dispatch_batches has rank 0 read the data "
            "for all ranks; drop dispatch_batches (a stream is dealt out example by example instead)."
        )
