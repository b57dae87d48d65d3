"""The Trainer's training dataloader (HF's override point `get_train_dataloader`) and what every loader the
Trainer builds shares with HF's `_get_dataloader`: the model's inputs only (`remove_unused_columns`, see
kiln.engine.data.columns) and, for training, `group_by_length` on what remains.

A mixin of the Trainer: it reads the Trainer's config, strategy, run and datasets."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from kiln.engine.data.loaders import build_dataloader, default_data_collator
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from torch import nn

    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)


class DataLoaderMixin:
    config: Any
    strategy: Strategy
    run: Any  # kiln.engine.run.Run (a floor above this one)
    model: nn.Module
    train_dataset: Any
    data_collator: Callable[[list[Any]], Any] | None
    processing_class: Any

    def get_train_dataloader(self) -> Iterable[Any]:
        """kiln's sampler (seeded by (data_seed, epoch), sharded over ranks, resumable in O(1)) over the
        model's inputs. A DataLoader passed as train_dataset is used as given."""
        if self.train_dataset is None:
            raise KilnError("Trainer.fit() needs a train_dataset (or override get_train_dataloader).")
        if isinstance(self.train_dataset, torch.utils.data.DataLoader):
            self.train_dataset.kiln_as_given = (
                True  # its epochs run as a plain loop runs them (loaders.reads_to_the_end)
            )
            return self.strategy.process_dataloader(self.train_dataset)
        cfg, strategy = self.config, self.strategy
        seed = cfg.data_seed if cfg.data_seed is not None else cfg.seed
        drop_last = bool(
            cfg.data.dataloader_drop_last or strategy.capabilities.static_shapes
        )  # see kiln.engine.data.static_shapes
        dataset, collator = self._model_inputs(self.train_dataset, "Training")
        if cfg.data.packing.strategy is not None or cfg.data.packing.padding_free:  # kiln.engine.data.packing
            from kiln.engine.data.packing import packed_training_data

            dataset, collator = packed_training_data(
                dataset,
                collator,
                user_collator=self.data_collator,
                model=self.model,
                training_module=self.run.facts.training_module,
                data_cfg=cfg.data,
                strategy=strategy,
            )
        loader = build_dataloader(
            dataset,
            self.run.micro_batch_size,
            collator,
            cfg.data,
            seed,
            shuffle=True,
            num_replicas=strategy.data_shards,
            rank=strategy.data_shard_rank,
            sampler=self._length_grouped_sampler(dataset, seed),
            drop_last=drop_last,
            pin_memory=strategy.accelerator.pin_memory,
            broadcast=strategy.broadcast_object,
        )
        if drop_last and not cfg.data.dataloader_drop_last:
            from kiln.engine.data.static_shapes import report_drop_last

            report_drop_last(dataset, loader, strategy.data_shards, strategy.name)
        return strategy.process_dataloader(loader)

    def _model_inputs(self, dataset: Any, description: str) -> tuple[Any, Callable[[list[Any]], Any] | None]:
        """(dataset, collator) for a loader over `dataset`: with `remove_unused_columns` and an HF-contract
        model, without what its forward does not take (HF's `_get_dataloader`)."""
        if not self.config.data.remove_unused_columns or self.run.facts.training_module:
            return dataset, self.data_collator
        from kiln.engine.data.columns import without_unused_columns

        return without_unused_columns(
            dataset, self.data_collator, self.model, self.run.facts.label_names, description, default_data_collator
        )

    def _length_grouped_sampler(self, dataset: Any, seed: int) -> Any:
        if not self.config.data.group_by_length:
            return None
        from kiln.engine.data.length_grouping import LengthGroupedSampler
        from kiln.engine.data.loaders import is_sized

        if not is_sized(dataset) or isinstance(dataset, torch.utils.data.IterableDataset):
            log.warning(
                "group_by_length is ignored: the training dataset is a stream without a length, whose "
                "examples are read in its own order (as HF does)."
            )
            return None
        names = getattr(self.processing_class, "model_input_names", None)
        s = self.strategy
        return LengthGroupedSampler.for_dataset(
            dataset,
            self.config.data,
            seed,
            self.run.micro_batch_size,
            self.run.accumulation,
            s.data_shards,
            s.data_shard_rank,
            names[0] if names else "input_ids",
        )
