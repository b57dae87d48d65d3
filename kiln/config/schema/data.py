"""`data`: the dataloaders and packing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from kiln.config.schema.fields import opt


@dataclass
class PackingConfig:
    """Packing: several examples per row, each with its own positions and attention (TRL's packing)."""

    strategy: Optional[str] = opt(
        None,
        "How training examples become rows of max_length tokens: bfd (best-fit decreasing: whole examples, one "
        "longer than max_length cut to it), bfd_split (the same, an overlong example split into max_length pieces), "
        "wrapped (concatenated in order and cut every max_length tokens; a piece continuing in the next row starts "
        "there at position 0, as a new example); null: examples are not packed. Attention and positions restart at "
        "every example, and no token is trained to predict the next example's first token "
        "([fine-tuning](fine-tuning.md#packing)).",
    )
    max_length: int = opt(1024, "Tokens per packed row (TRL's max_length).")
    padding_free: Optional[bool] = opt(
        None,
        "Concatenate each micro-batch (its packed rows, or its examples when strategy is null) into one row "
        "without padding; false: rows are padded to the longest row of the micro-batch. Unset: true with "
        "flash-attention implementations (varlen kernels), false with sdpa, eager and flex_attention (whose masks "
        "grow with the square of a row's tokens).",
    )


@dataclass
class DataConfig:
    """Dataloaders."""

    per_device_train_batch_size: int = opt(8, "Training batch size per process.")
    per_device_eval_batch_size: int = opt(8, "Evaluation batch size per process.")
    dataloader_num_workers: int = opt(0, "Worker processes per dataloader (0 loads in the main process).")
    dataloader_pin_memory: bool = opt(True, "Pin host memory (only has an effect with an accelerator).")
    dataloader_drop_last: bool = opt(False, "Drop the last incomplete batch.")
    dataloader_persistent_workers: bool = opt(False, "Keep workers alive between epochs.")
    dataloader_prefetch_factor: Optional[int] = opt(None, "Batches each worker loads ahead.")
    auto_find_batch_size: bool = opt(
        False,
        "Before training, lower per_device_train_batch_size by 10% steps until the first step fits in memory; a later "
        "out-of-memory error (one process) in a step's forward/backward redoes the step with smaller micro-batches and more "
        "accumulation; elsewhere (optimizer step, callbacks) it restarts training 10% smaller, as HF does.",
    )
    group_by_length: bool = opt(False, "Group samples of similar length into batches (less padding).")
    length_column_name: str = opt("length", "Key holding precomputed lengths for group_by_length.")
    remove_unused_columns: bool = opt(True, "Drop batch keys the model's forward() does not accept (HF models).")
    label_names: Optional[List[str]] = opt(None, "Batch keys that hold labels (default: 'labels'-like keys).")
    split_batches: bool = opt(
        False,
        "The configured batch sizes are global: each of the N data-parallel ranks gets batch_size / N "
        "(which must divide evenly).",
    )
    dispatch_batches: bool = opt(
        False,
        "Rank 0 alone iterates the training data and sends every rank its slice of each global batch "
        "(for streaming datasets that cannot shard themselves).",
    )
    even_batches: bool = opt(
        True,
        "Pad every rank's shard with samples from the start so that all ranks get equal batches; false: no "
        "sample is repeated and the last global batch is smaller instead.",
    )
    use_seedable_sampler: bool = opt(
        True,
        "Shuffle with an order that depends only on (data_seed, epoch), the same on every rank "
        "(kiln's sampler always is; false is refused because resume could not reproduce the order).",
    )
    dataloader_multiprocessing_context: Optional[str] = opt(
        None, "Start method of the worker processes: fork, spawn or forkserver."
    )
    dataloader_in_order: bool = opt(True, "Yield batches in order; false yields each as soon as a worker has it.")
    packing: PackingConfig = field(default_factory=PackingConfig)
