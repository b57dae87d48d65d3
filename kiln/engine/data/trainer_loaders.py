"""The loaders a Trainer builds (`TrainerLoaders`, one per Trainer, over its config and strategy): the
training loader behind HF's override point `get_train_dataloader`, the evaluation and prediction loaders
behind `get_eval_dataloader` / `get_test_dataloader` (eval_loaders.py), and what all of them share with
HF's `_get_dataloader`: the model's inputs only (`remove_unused_columns`, see kiln.engine.data.columns)
and, for training, `group_by_length` on what remains.

The Trainer's HF methods delegate here with what is theirs (its datasets, collator and processing class,
which HF code may reassign at any time) and what is the fit's (the `Run`: its model, facts, live batch
sizes and reused evaluation loaders), so a subclass overriding `get_train_dataloader` is still what the
loops call."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from kiln.engine.data.collator import default_data_collator
from kiln.engine.data.eval_loaders import eval_dataloader, test_dataloader
from kiln.engine.data.loaders import build_dataloader
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.run import Run
    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)

#: a Trainer's `data_collator`: a list of examples -> a batch (None: kiln's default)
Collator = Callable[[list[Any]], Any] | None


class TrainerLoaders:
    """The DataLoaders of one Trainer (its config and strategy are fixed for its life)."""

    def __init__(self, config: Any, strategy: Strategy) -> None:
        self.config, self.strategy = config, strategy

    def train(self, run: Run, dataset: Any, collator: Collator, processing_class: Any) -> Iterable[Any]:
        """kiln's sampler (seeded by (data_seed, epoch), sharded over ranks, resumable in O(1)) over the
        model's inputs. A DataLoader passed as the training dataset is used as given."""
        if dataset is None:
            raise KilnError("Trainer.fit() needs a train_dataset (or override get_train_dataloader).")
        cfg, strategy = self.config, self.strategy
        if isinstance(dataset, torch.utils.data.DataLoader):
            dataset.kiln_as_given = True  # its epochs run as a plain loop runs them (loaders.reads_to_the_end)
            return strategy.process_dataloader(dataset)
        seed = cfg.data_seed if cfg.data_seed is not None else cfg.seed
        # see kiln.engine.data.static_shapes
        drop_last = bool(cfg.data.dataloader_drop_last or strategy.capabilities.static_shapes)
        dataset, batch_collator = self.model_inputs(run, collator, dataset, "Training")
        if cfg.data.packing.strategy is not None or cfg.data.packing.padding_free:  # kiln.engine.data.packing
            from kiln.engine.data.packing import packed_training_data

            dataset, batch_collator = packed_training_data(
                dataset,
                batch_collator,
                user_collator=collator,
                model=run.model,
                training_module=run.facts.training_module,
                data_cfg=cfg.data,
                strategy=strategy,
            )
        loader = build_dataloader(
            dataset,
            run.micro_batch_size,
            batch_collator,
            cfg.data,
            seed,
            shuffle=True,
            num_replicas=strategy.data_shards,
            rank=strategy.data_shard_rank,
            sampler=self._length_grouped_sampler(run, dataset, seed, processing_class),
            drop_last=drop_last,
            pin_memory=strategy.accelerator.pin_memory,
            broadcast=strategy.broadcast_object,
        )
        if drop_last and not cfg.data.dataloader_drop_last:
            from kiln.engine.data.static_shapes import report_drop_last

            report_drop_last(dataset, loader, strategy.data_shards, strategy.name)
        return strategy.process_dataloader(loader)

    def eval(self, run: Run, own: Any, eval_dataset: Any, collator: Collator) -> Iterable[Any]:
        """The eval loader over `eval_dataset` (a dataset, the name of one in the Trainer's dict `own`, or None
        for `own`): in order, sharded contiguously over ranks; reused from the run's `eval_loaders` with
        `dataloader_persistent_workers` (eval_loaders.py)."""
        inputs = partial(self.model_inputs, run, collator)
        return eval_dataloader(self.config, self.strategy, own, eval_dataset, run.eval_loaders, inputs)

    def test(self, run: Run, test_dataset: Any, collator: Collator) -> Iterable[Any]:
        return test_dataloader(self.config, self.strategy, test_dataset, partial(self.model_inputs, run, collator))

    def model_inputs(self, run: Run, collator: Collator, dataset: Any, description: str) -> tuple[Any, Collator]:
        """(dataset, collator) for a loader over `dataset`: with `remove_unused_columns` and an HF-contract
        model, without what its forward does not take (HF's `_get_dataloader`)."""
        if not self.config.data.remove_unused_columns or run.facts.training_module:
            return dataset, collator
        from kiln.engine.data.columns import without_unused_columns

        return without_unused_columns(
            dataset, collator, run.model, run.facts.label_names, description, default_data_collator
        )

    def _length_grouped_sampler(self, run: Run, dataset: Any, seed: int, processing_class: Any) -> Any:
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
        names = getattr(processing_class, "model_input_names", None)
        s = self.strategy
        return LengthGroupedSampler.for_dataset(
            dataset,
            self.config.data,
            seed,
            run.micro_batch_size,
            run.accumulation,
            s.data_shards,
            s.data_shard_rank,
            names[0] if names else "input_ids",
        )
