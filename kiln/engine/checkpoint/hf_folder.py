"""Telling a checkpoint folder HF's Trainer wrote from a damaged kiln one, and vetting its weights.

An HF checkpoint has no COMPLETE marker, so nothing records its files' sizes or checksums. A kiln
checkpoint that lost its marker (and its config.yaml and loop state) must not pass for one: it would
resume with no integrity check at all. kiln's own files identify it (`KILN_FILES`, kiln's metadata in
`model.safetensors`), and such a folder is damaged. A genuine HF checkpoint's weights are at least
checked for what can be checked without a record: each safetensors file's length against its own
header, every shard the index names present and holding the tensors it is said to hold, and finite
values in every floating-point tensor."""

from __future__ import annotations

import fnmatch
import json
import os
import struct

from kiln.engine.checkpoint.integrity import MARKER
from kiln.utils.errors import CheckpointError

STATE = "trainer_state.json"
#: files and folders only kiln writes into a checkpoint (HF's Trainer writes none of them); the sharded
#: strategies' folders (fsdp_dcp/, ds/, ...) are named here rather than imported, to keep this module light
#: (tests/strategies/test_checkpoint_formats.py checks them against the strategies' own names; model_parallel_dcp
#: is the folder model_parallel wrote before it became a preset of the mesh strategy, still resumable)
KILN_FILES = (
    MARKER,
    "config.yaml",
    "kiln_loop_position.json",
    "precision.pt",
    "loop_state_*.pt",
    "fsdp_dcp",
    "model_parallel_dcp",
    "xla_dcp",
    "xla_fsdp_classic",
    "ds",
)
_SAFE, _INDEX, _BIN = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
_ADAPTERS = ("adapter_model.safetensors", "adapter_model.bin")


def _has_kiln_metadata(path: str) -> bool:
    """Whether the safetensors file at `path` carries kiln's metadata (`kiln_aliases`)."""
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(min(length, 100 << 20)))
        return "kiln_aliases" in (header.get("__metadata__") or {})
    except (OSError, ValueError, AttributeError, struct.error):
        return False


def kiln_files(path: str) -> list[str]:
    """The files in `path` that only kiln writes into a checkpoint."""
    names = os.listdir(path) if os.path.isdir(path) else []
    found = sorted({n for n in names for pattern in KILN_FILES if fnmatch.fnmatchcase(n, pattern)})
    if _SAFE in names and _has_kiln_metadata(os.path.join(path, _SAFE)):
        found.append(f"{_SAFE} (kiln's metadata)")
    return found


def is_hf_checkpoint(path: str) -> bool:
    """A folder HF's Trainer wrote: its trainer_state.json and none of kiln's own files (a kiln
    checkpoint without its marker is damaged, not foreign)."""
    return os.path.isfile(os.path.join(path, STATE)) and not kiln_files(path)


def missing_marker_reason(path: str) -> str:
    """Why a folder without a COMPLETE marker is no checkpoint to trust (for the refusal)."""
    found = kiln_files(path)
    if found:
        return (
            f"it holds kiln's own files ({', '.join(found[:4])}) but no {MARKER} marker, so it is a damaged kiln "
            "checkpoint (or a save_model export), not one HF's Trainer wrote"
        )
    return f"it has no {MARKER} marker"


def _finite_problem(name: str, tensors: dict) -> str | None:
    import torch

    for key, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name} holds non-finite values (nan or inf) in {key}"
    return None


def _safetensors_problem(folder: str, name: str, expected: set[str] | None = None) -> str | None:
    from safetensors import safe_open

    from kiln.strategies.weights_files import safetensors_intact

    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{name} is missing"
    if not safetensors_intact(path):
        return f"{name} is truncated or its header is damaged (its size does not match its header)"
    try:
        with safe_open(path, framework="pt") as fh:
            keys = set(fh.keys())
            if expected is not None and (absent := sorted(expected - keys)):
                return f"{name} lacks {', '.join(absent[:5])}, which {_INDEX} places there"
            for key in sorted(keys):
                if problem := _finite_problem(name, {key: fh.get_tensor(key)}):
                    return problem
    except Exception as err:  # safetensors raises its own error types for damaged files
        return f"{name} is unreadable ({type(err).__name__})"
    return None


def hf_weights_damage(path: str) -> str | None:
    """Why the weights of the HF checkpoint at `path` cannot be trusted, or None (module docstring)."""
    from kiln.strategies.weights_files import read_index
    from kiln.utils.errors import safe_torch_load

    names = set(os.listdir(path))
    if _SAFE in names:
        return _safetensors_problem(path, _SAFE)
    if _INDEX in names:
        try:
            weight_map = read_index(path)["weight_map"]
        except CheckpointError as err:
            return str(err)
        shards: dict[str, set[str]] = {}
        for tensor, shard in weight_map.items():
            shards.setdefault(str(shard), set()).add(str(tensor))
        for shard, tensors in sorted(shards.items()):
            if problem := _safetensors_problem(path, shard, tensors):
                return problem
        return None
    for name in (_BIN, *_ADAPTERS):
        if name not in names:
            continue
        if name.endswith(".safetensors"):
            return _safetensors_problem(path, name)
        try:
            state = safe_torch_load(os.path.join(path, name))
        except CheckpointError as err:
            return str(err)
        return _finite_problem(name, state) if isinstance(state, dict) else f"{name} does not hold a state dict"
    return f"it holds no model weights ({_SAFE}, {_INDEX}, {_BIN} or an adapter)"
