"""The Trainer's evaluation and prediction loaders (HF's override points `get_eval_dataloader` and
`get_test_dataloader` call these): in order, sharded contiguously over ranks (SequentialDistributedSampler),
over the model's inputs (`model_inputs`: the Trainer's `remove_unused_columns` step, see trainer_loaders.py),
and HF's `_eval_dataloaders` reuse with persistent workers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from kiln.engine.data.checks import check_eval_dataset
from kiln.engine.data.samplers import SequentialDistributedSampler
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from kiln.strategies.base import Strategy

#: (dataset, description) -> (dataset, collator): the model's inputs only (the Trainer's `_model_inputs`)
ModelInputs = Callable[[Any, str], tuple[Any, Any]]


def eval_dataloader(
    config: Any,
    strategy: Strategy,
    own: Any,
    eval_dataset: Any,
    cache: dict[str, Any],
    model_inputs: ModelInputs,
) -> Iterable[Any]:
    """The loader over `eval_dataset` (a dataset, the name of one in the Trainer's dict `own`, or None for
    `own`). With `dataloader_persistent_workers` it is reused from `cache` (see `cached_eval_loader`)."""
    if not config.data.dataloader_persistent_workers:
        return build_eval_dataloader(config, strategy, own, eval_dataset, model_inputs)
    return cached_eval_loader(
        cache, own, eval_dataset, lambda dataset: build_eval_dataloader(config, strategy, own, dataset, model_inputs)
    )


def build_eval_dataloader(
    config: Any, strategy: Strategy, own: Any, eval_dataset: Any, model_inputs: ModelInputs
) -> Iterable[Any]:
    name = f"eval_dataset {eval_dataset!r}" if isinstance(eval_dataset, str) else "eval_dataset"
    if isinstance(eval_dataset, str):
        named = own if isinstance(own, Mapping) else {}
        if eval_dataset not in named:
            raise KilnError(
                f"No eval dataset named {eval_dataset!r}; the Trainer's eval_dataset dict has: {', '.join(named) or 'none'}."
            )
        eval_dataset = named[eval_dataset]
    dataset = eval_dataset if eval_dataset is not None else own
    if dataset is None:
        raise KilnError("evaluate() needs an eval_dataset: pass one to Trainer(...) or to evaluate().")
    check_eval_dataset(dataset, name, "pass evaluate() a dataset with items")
    if isinstance(dataset, Mapping):
        raise KilnError("get_eval_dataloader takes one dataset; evaluate() runs a dict of them one by one.")
    return sequential_loader(config, strategy, dataset, model_inputs)


def test_dataloader(config: Any, strategy: Strategy, test_dataset: Any, model_inputs: ModelInputs) -> Iterable[Any]:
    if test_dataset is None:
        raise KilnError("predict() needs a test_dataset.")
    return sequential_loader(config, strategy, test_dataset, model_inputs)


def sequential_loader(config: Any, strategy: Strategy, dataset: Any, model_inputs: ModelInputs) -> Iterable[Any]:
    from kiln.engine.data.dispatch_batches import per_rank_batch_size
    from kiln.engine.data.loaders import build_dataloader, is_sized

    s, cfg = strategy, config
    if isinstance(dataset, torch.utils.data.DataLoader):
        return s.process_dataloader(dataset)  # used as given
    batch_size, drop_last = cfg.data.per_device_eval_batch_size, cfg.data.dataloader_drop_last
    batch_size = per_rank_batch_size(batch_size, cfg.data.split_batches, s.data_shards, "per_device_eval_batch_size")
    sampler = None
    if is_sized(dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
        sampler = SequentialDistributedSampler(
            len(dataset), s.data_shards, s.data_shard_rank, batch_size if drop_last else None, drop_last
        )
    dataset, collator = model_inputs(dataset, "Evaluation")  # remove_unused_columns (HF)
    loader = build_dataloader(
        dataset,
        batch_size,
        collator,
        cfg.data,
        cfg.seed,
        shuffle=False,
        num_replicas=s.data_shards,
        rank=s.data_shard_rank,
        sampler=sampler,
        drop_last=None if sampler is None else False,  # the sampler already dropped
        pin_memory=s.accelerator.pin_memory,
    )
    return s.process_dataloader(loader)


def cached_eval_loader(cache: dict[str, Any], own: Any, eval_dataset: Any, build: Callable[[Any], Any]) -> Any:
    """HF's `_eval_dataloaders` with persistent workers: the loader for `eval_dataset` (a name of the Trainer's
    dict `own`, a dataset, or None for `own`) built once under its name ("eval" for anything but a name) and
    reused while that key still means the same dataset object. HF reuses it whatever is passed later, so
    `evaluate(other)` would evaluate the dataset passed first."""
    key = eval_dataset if isinstance(eval_dataset, str) else "eval"
    if isinstance(eval_dataset, str):
        source = own.get(eval_dataset) if isinstance(own, Mapping) else None
    else:
        source = eval_dataset if eval_dataset is not None else own
    cached = cache.get(key)
    if cached is not None and getattr(cached, "kiln_eval_source", None) is source:
        return cached
    loader = cache[key] = build(eval_dataset)
    loader.kiln_eval_source = source  # what the key meant when it was built
    return loader
