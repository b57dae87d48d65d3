"""`kiln convert CHECKPOINT OUT`: one `model.safetensors` from any kiln checkpoint, in this process,
whatever strategy and number of processes saved it, plus the files that make OUT load as
`save_pretrained` leaves a folder: the model's `config.json` and `generation_config.json` and the
tokenizer's files, where the checkpoint holds them, so `AutoModel...from_pretrained(OUT)` builds the
trained model (not a default one), and `safetensors.torch.load_model` fills the plain model.

The checkpoint's COMPLETE marker names its format; the format registry
(kiln.strategies.checkpoint_io.FORMATS) gives the CheckpointIO class that wrote it, whose
`consolidate` reads the full weights, importing only that format's module. A sharded format holds
each tied weight (GPT-2's `lm_head.weight`, which is `transformer.wte.weight`) as a tensor of its
own, so the ties the model had, recorded in the marker when it was saved, are applied again and each
is stored once, under the name `save_pretrained` keeps (kiln.strategies.weights_files.share_tied).
The checkpoint is checked as for a resume first (sizes, checksums, and the signature where
`--signing-key-env` names the key). Every format's reader vets each pickle first (kiln.utils.safe_pickle, DeepSpeed's allow-list), since
torch's DCP reader and `zero_to_fp32` would unpickle them unchecked: converting a checkpoint never runs
code from it."""

from __future__ import annotations

import os
from typing import Any

from kiln.engine.checkpoint.files import read_marker, why_damaged, why_incomplete
from kiln.engine.checkpoint.hf_files import copy_model_files
from kiln.engine.checkpoint.remote_run import fetch_checkpoint
from kiln.engine.checkpoint.signing import SigningKey
from kiln.registry import UnknownNameError
from kiln.strategies.checkpoint_io import FORMATS
from kiln.strategies.model_weights import save_weights
from kiln.strategies.weights_files import share_tied
from kiln.utils.errors import CheckpointError
from kiln.utils.storage_urls import is_remote


def convert_checkpoint(
    checkpoint: str, output_dir: str, key: SigningKey | None = None, storage_options: dict[str, Any] | None = None
) -> str:
    """Write the checkpoint's full weights to `output_dir/model.safetensors`, and its model and
    tokenizer files beside them; returns the weights file's path. The checkpoint must be complete and
    intact, as for a resume, and signed with `key` when one is given (kiln.engine.checkpoint.signing).
    A checkpoint URL (`s3://bucket/run/checkpoint-500`) is downloaded first, digests checked, with
    `storage_options` (default: the store's own configuration, as fsspec reads it)."""
    if is_remote(checkpoint):
        checkpoint = fetch_checkpoint(checkpoint, storage_options, key)
    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a checkpoint folder.")
    if (reason := why_incomplete(checkpoint)) is not None:
        raise CheckpointError(f"{checkpoint} is incomplete or damaged ({reason}); convert another checkpoint.")
    if (reason := why_damaged(checkpoint, key)) is not None:
        raise CheckpointError(f"{checkpoint} is damaged: {reason}; convert another checkpoint.")
    marker = read_marker(checkpoint)
    fmt = str(marker.get("format", "full"))
    try:
        io = FORMATS.get(fmt)
    except UnknownNameError:
        raise CheckpointError(
            f"kiln convert cannot read checkpoints of format {fmt!r}; it reads {', '.join(FORMATS.names())}."
        ) from None
    state = share_tied(io.consolidate(checkpoint), marker.get("tied"))
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, save_weights(state, output_dir, safetensors=True))
    copy_model_files(checkpoint, output_dir)
    return path
