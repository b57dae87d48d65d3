"""`kiln convert CHECKPOINT OUT`: one `model.safetensors` from any kiln checkpoint, in this process,
whatever number of processes saved it. The checkpoint's marker names its format; each format says
how its full weights are read."""

from __future__ import annotations

import os
from typing import Callable

import torch

from kiln.engine.checkpoint.files import read_marker
from kiln.strategies.checkpoint_io import load_weights, save_weights
from kiln.utils.errors import CheckpointError


def _sharded_fsdp(path: str) -> dict[str, torch.Tensor]:
    from kiln.strategies.fsdp_checkpoint_io import consolidate

    return consolidate(path)


#: checkpoint format (the marker's "format") -> reader of its full weights
READERS: dict[str, Callable[[str], dict[str, torch.Tensor]]] = {
    "full": load_weights,
    "fsdp-full": load_weights,
    "fsdp-sharded": _sharded_fsdp,
}


def convert_checkpoint(checkpoint: str, output_dir: str) -> str:
    """Write the checkpoint's full weights to `output_dir/model.safetensors`; returns the file path."""
    fmt = read_marker(checkpoint).get("format", "full")
    reader = READERS.get(fmt)
    if reader is None:
        raise CheckpointError(f"kiln convert cannot read checkpoints of format {fmt!r}; it reads {', '.join(sorted(READERS))}.")
    state = reader(checkpoint)
    os.makedirs(output_dir, exist_ok=True)
    return os.path.join(output_dir, save_weights(state, output_dir, safetensors=True))
