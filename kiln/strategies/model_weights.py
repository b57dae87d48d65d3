"""The model's weights as files: `save_weights` writes a full state dict (`model.safetensors` with tied
weights stored once and their aliases in the metadata, `pytorch_model.bin`, or HF-layout shards above
`max_shard_size`), `load_weights` reads any of them back without unpickling arbitrary objects, and
`apply_weights` loads a state dict into a module, naming every missing, unexpected or mis-shaped key."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from kiln.strategies.safetensors_writer import write_safetensors
from kiln.strategies.weights_files import INDEX, load_sharded, parse_size, save_sharded
from kiln.utils.errors import CheckpointError, safe_torch_load

WEIGHTS_SAFE = "model.safetensors"
WEIGHTS_BIN = "pytorch_model.bin"


def save_weights(
    state: dict[str, torch.Tensor],
    directory: str,
    safetensors: bool = True,
    max_shard_size: int | str | None = None,
    *,
    in_background: bool = False,
) -> str:
    """Write a full state dict; returns the file name written (the index when sharded: with
    `max_shard_size`, weights above it are split into HF-layout shards). `in_background`: the caller is
    a thread writing while training goes on, so `model.safetensors` is written by kiln's own writer,
    which holds no GIL while it writes (kiln.strategies.safetensors_writer): the same bytes."""
    if not safetensors:
        torch.save(state, os.path.join(directory, WEIGHTS_BIN))
        return WEIGHTS_BIN
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:  # tied weights: store once, remember the alias
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.to("cpu").contiguous()
    meta = {"format": "pt", "kiln_aliases": json.dumps(aliases)}
    if max_shard_size is not None and sum(t.numel() * t.element_size() for t in tensors.values()) > parse_size(
        max_shard_size
    ):
        save_sharded(tensors, directory, max_shard_size, metadata={"kiln_aliases": meta["kiln_aliases"]})
        return INDEX
    if in_background:
        write_safetensors(tensors, os.path.join(directory, WEIGHTS_SAFE), metadata=meta)
    else:
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(directory, WEIGHTS_SAFE), metadata=meta)
    return WEIGHTS_SAFE


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """Read the weights a checkpoint or exported model folder holds (safetensors preferred)."""
    safe = os.path.join(directory, WEIGHTS_SAFE)
    if os.path.exists(safe):
        from safetensors import safe_open

        try:
            with safe_open(safe, framework="pt") as fh:
                meta = fh.metadata() or {}
                state = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 - safe_open is no dict
            aliases = json.loads(meta.get("kiln_aliases", "{}"))
        except Exception as err:  # safetensors raises its own error types for truncated files
            raise CheckpointError(f"{safe} is corrupt or truncated ({err}); resume from another checkpoint.") from None
        for alias, source in aliases.items():
            if source not in state:
                raise CheckpointError(
                    f"{safe} is damaged: tied weight {alias!r} points at {source!r}, which it does not hold."
                )
            state[alias] = state[source]
        return state
    if os.path.exists(os.path.join(directory, INDEX)):  # sharded (save_pretrained / save_model with max_shard_size)
        state, meta = load_sharded(directory)
        for alias, source in json.loads(meta.get("kiln_aliases", "{}")).items():
            if source not in state:
                raise CheckpointError(
                    f"{directory}/{INDEX} is damaged: tied weight {alias!r} points at {source!r}, which no shard holds."
                )
            state[alias] = state[source]
        return state
    binary = os.path.join(directory, WEIGHTS_BIN)
    if os.path.exists(binary):
        state = safe_torch_load(binary)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{binary} does not hold a state dict (a mapping of names to tensors).")
        return state
    raise CheckpointError(
        f"No model weights ({WEIGHTS_SAFE}, {INDEX} with its shards, or {WEIGHTS_BIN}) in {directory}."
    )


def apply_weights(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` into `module`, naming every missing, unexpected or mis-shaped key on mismatch.

    A model that overrides `load_state_dict` (e.g. it resizes a buffer grown during training) is
    loaded through its own method, as HF does: kiln's shape pre-check would wrongly refuse it."""
    if type(module).load_state_dict is not nn.Module.load_state_dict:
        try:
            module.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(
                f"{type(module).__name__}.load_state_dict refused the checkpoint {source} ({first})."
            ) from None
        return
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    # Tied weights HF's save_pretrained stores once (GPT-2's lm_head.weight is wte.weight): a key the
    # file lacks is fine when the model ties it to one the file has; loading that one fills both.
    where = _storage_key
    present = {where(own[k]) for k in own if k in state}
    tied = {k for k in missing if own[k].numel() and where(own[k]) in present}
    missing = [k for k in missing if k not in tied]
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(
        f"{k} (checkpoint {tuple(state[k].shape)}, model {tuple(own[k].shape)})"
        for k in set(own) & set(state)
        if tuple(own[k].shape) != tuple(state[k].shape)
    )
    if missing or unexpected or shapes:
        parts = []
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped keys", shapes)):
            if keys:
                shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
                parts.append(f"{label}: {shown}")
        raise CheckpointError(
            f"The checkpoint {source} does not fit this model ({'; '.join(parts)}). "
            "It was saved from a different model: resume with the model it was trained with, or start a fresh output_dir."
        )
    module.load_state_dict(state, strict=not tied)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's data lives, so that two names of one storage (a tie) compare equal. Device
    tensors without host-visible storage (XLA) are told apart by identity."""
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    except RuntimeError:
        return (id(t), 0, tuple(t.shape))
