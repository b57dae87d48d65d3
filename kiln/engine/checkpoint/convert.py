"""`kiln convert CHECKPOINT OUT`: one `model.safetensors` from any kiln checkpoint, in this process,
whatever strategy and number of processes saved it. The checkpoint's COMPLETE marker names its
format; each format says how its full weights are read (FSDP's DCP shards are merged here,
DeepSpeed's ZeRO shards by `zero_to_fp32` in its strategy's files). Both readers vet every pickle first
(kiln.utils.safe_pickle, deepspeed_checkpoint_io.vet_ds_files), since torch's DCP reader and
`zero_to_fp32` would unpickle them unchecked: converting a checkpoint never runs code from it."""

from __future__ import annotations

import os
from typing import Callable

import torch

from kiln.engine.checkpoint.files import read_marker
from kiln.strategies.checkpoint_io import load_weights, save_weights
from kiln.utils.errors import CheckpointError


def _sharded_fsdp(path: str) -> dict[str, torch.Tensor]:
    from kiln.strategies.fsdp.checkpoint_io import consolidate

    return consolidate(path)


def _xla_spmd(path: str) -> dict[str, torch.Tensor]:
    from kiln.strategies.xla.fsdp_checkpoint_io import consolidate_spmd

    return consolidate_spmd(path)


def _xla_classic(path: str) -> dict[str, torch.Tensor]:
    from kiln.strategies.xla.fsdp_checkpoint_io import consolidate_classic

    return consolidate_classic(path)


#: checkpoint format (the marker's "format") -> reader of its full weights
READERS: dict[str, Callable[[str], dict[str, torch.Tensor]]] = {
    "full": load_weights,
    "fsdp-full": load_weights,
    "fsdp-sharded": _sharded_fsdp,
    "xla-full": load_weights,
    "xla-spmd-sharded": _xla_spmd,
    "xla-fsdp-classic": _xla_classic,
}


def convert_checkpoint(checkpoint: str, output_dir: str) -> str:
    """Write the checkpoint's full weights to `output_dir/model.safetensors`; returns the file path."""
    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a checkpoint folder.")
    fmt = read_marker(checkpoint).get("format", "full")
    if fmt == "deepspeed":  # zero_to_fp32 writes the file itself
        from kiln.strategies.deepspeed.checkpoint_io import convert_deepspeed

        return convert_deepspeed(checkpoint, output_dir)
    reader = READERS.get(fmt)
    if reader is None:
        known = ", ".join(sorted([*READERS, "deepspeed"]))
        raise CheckpointError(f"kiln convert cannot read checkpoints of format {fmt!r}; it reads {known}.")
    state = reader(checkpoint)
    os.makedirs(output_dir, exist_ok=True)
    return os.path.join(output_dir, save_weights(state, output_dir, safetensors=True))
