"""`kiln convert CHECKPOINT OUT`: a checkpoint's full model weights as one `model.safetensors` in OUT,
whatever strategy and process count wrote it. Dispatches on the format its COMPLETE marker records;
each sharded format's strategy file provides the merge (DeepSpeed: `convert_deepspeed`)."""

from __future__ import annotations

import os

from kiln.engine.checkpoint.files import read_marker
from kiln.utils.errors import CheckpointError


def convert(checkpoint: str, out: str) -> str:
    """Write the consolidated weights of `checkpoint` into `out`; returns the file written."""
    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a checkpoint folder.")
    fmt = read_marker(checkpoint).get("format", "full")
    if fmt == "deepspeed":
        from kiln.strategies.deepspeed_checkpoint_io import convert_deepspeed

        return convert_deepspeed(checkpoint, out)
    if fmt == "full":
        from kiln.strategies.checkpoint_io import load_weights, save_weights

        os.makedirs(out, exist_ok=True)
        return os.path.join(out, save_weights(load_weights(checkpoint), out))
    raise CheckpointError(f"kiln convert does not know checkpoint format {fmt!r} (from {checkpoint}); "
                          "it converts 'full' and 'deepspeed' checkpoints.")
