"""`kiln convert CHECKPOINT OUT`: one `model.safetensors` from any kiln checkpoint, in this process,
whatever strategy and number of processes saved it. The checkpoint's COMPLETE marker names its
format; the format registry (kiln.strategies.checkpoint_io.FORMATS) gives the CheckpointIO class
that wrote it, whose `consolidate` reads the full weights, importing only that format's module. Every
format's reader vets each pickle first (kiln.utils.safe_pickle, DeepSpeed's allow-list), since torch's
DCP reader and `zero_to_fp32` would unpickle them unchecked: converting a checkpoint never runs code
from it."""

from __future__ import annotations

import os

from kiln.engine.checkpoint.files import read_marker
from kiln.registry import UnknownNameError
from kiln.strategies.checkpoint_io import FORMATS, save_weights
from kiln.utils.errors import CheckpointError


def convert_checkpoint(checkpoint: str, output_dir: str) -> str:
    """Write the checkpoint's full weights to `output_dir/model.safetensors`; returns the file path."""
    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a checkpoint folder.")
    fmt = str(read_marker(checkpoint).get("format", "full"))
    try:
        io = FORMATS.get(fmt)
    except UnknownNameError:
        raise CheckpointError(f"kiln convert cannot read checkpoints of format {fmt!r}; it reads "
                              f"{', '.join(FORMATS.names())}.") from None
    state = io.consolidate(checkpoint)
    os.makedirs(output_dir, exist_ok=True)
    return os.path.join(output_dir, save_weights(state, output_dir, safetensors=True))
