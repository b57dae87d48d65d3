"""Sharded safetensors in Hugging Face's layout: `model-00001-of-00003.safetensors`, ... plus
`model.safetensors.index.json` (`{"metadata": {"total_size": N}, "weight_map": {name: file}}`), as
`save_pretrained(max_shard_size=...)` writes them. kiln reads them wherever it reads weights
(checkpoints, load_best_model_at_end, `kiln evaluate/predict`) and `save_model` writes them above
`save.max_shard_size`.

`tie_groups` / `share_tied` keep tied weights (GPT-2's `lm_head.weight` is `transformer.wte.weight`)
stored once where the writer cannot see the tie in the tensors themselves: a consolidated sharded
checkpoint holds every name as its own tensor, so the ties the module had are recorded when it is
saved and applied again before the single file is written (`kiln convert`).

`safetensors_intact` checks a file's size against its own header (8-byte length, JSON header, data
up to the largest end offset): a truncated shard is caught without reading the tensors, so a
checkpoint whose weights were re-saved as shards can be told apart from a damaged one."""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

import torch

from kiln.utils.errors import CheckpointError

INDEX = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """`5GB` (10^9, as HF), `500MiB`, or a number of bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not match:
        raise ValueError(
            f"max_shard_size {size!r} is not a size: use bytes or a number with KB, MB, GB (or KiB, MiB, GiB)."
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def save_sharded(
    tensors: dict[str, torch.Tensor], directory: str, max_shard_size: int | str, metadata: dict[str, str] | None = None
) -> list[str]:
    """Write `tensors` in shards of at most `max_shard_size` bytes (a bigger tensor gets a shard of its
    own, as in HF) and the index; returns the shard file names."""
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}, fh, indent=2)
    return names


def read_index(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, INDEX)
    try:
        with open(path, encoding="utf-8") as fh:
            index = json.load(fh)
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError("no weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path} is damaged ({err}); it must be a safetensors index with a weight_map.") from None
    return index


def load_sharded(directory: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor the index names, read from its shard; and the index metadata."""
    from safetensors import safe_open

    index = read_index(directory)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        path = os.path.join(directory, file)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing but {INDEX} lists it; the sharded weights are incomplete.")
        try:
            with safe_open(path, framework="pt") as fh:
                state.update({name: fh.get_tensor(name) for name in fh.keys()})  # noqa: SIM118 - not a dict
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{path} is corrupt or truncated ({err}).") from None
    absent = sorted(set(index["weight_map"]) - set(state))
    if absent:
        raise CheckpointError(f"{directory}: {INDEX} names tensors no shard holds ({', '.join(absent[:5])}).")
    return state, {k: str(v) for k, v in (index.get("metadata") or {}).items()}


def tie_groups(module: Any) -> list[list[str]]:
    """Names of `module`'s parameters and buffers that are one tensor (tied weights), one list per tie,
    the name the single stored copy keeps first: as `save_pretrained`, the names a Transformers model
    declares as tied copies (`_tied_weights_keys`, e.g. `lm_head.weight`) give way to their source."""
    by_object: dict[int, list[str]] = {}
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, tensor in named:
            by_object.setdefault(id(tensor), []).append(name)
    copies = set(getattr(module, "_tied_weights_keys", None) or ())  # {copy: source} in transformers 5
    return [sorted(names, key=lambda n: n in copies) for names in by_object.values() if len(names) > 1]


def share_tied(state: dict[str, torch.Tensor], groups: Any) -> dict[str, torch.Tensor]:
    """`state` with each tie of `groups` (from `tie_groups`) made one tensor again, its kept name
    ahead of the others, so that the safetensors writer stores it once under that name and records the
    others as aliases. A tie whose tensors differ is not one (a damaged record): left as it is."""
    if not isinstance(groups, list):
        return state
    out = dict(state)
    aliases: set[str] = set()
    for group in groups:
        if not (isinstance(group, list) and group and all(isinstance(n, str) for n in group)) or group[0] not in state:
            continue
        kept = state[group[0]]
        for name in group[1:]:
            value = state.get(name)
            if (
                value is not None
                and value.shape == kept.shape
                and value.dtype == kept.dtype
                and torch.equal(value, kept)
            ):
                out[name] = kept
                aliases.add(name)
    return {**{k: v for k, v in out.items() if k not in aliases}, **{k: v for k, v in out.items() if k in aliases}}


def safetensors_intact(path: str) -> bool:
    """Whether the file is as long as its header says (not truncated, header readable)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                return False
            header = json.loads(fh.read(header_len))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return size == 8 + header_len + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def sharded_weights_intact(directory: str) -> bool:
    """Whether `directory` holds an index whose every shard is present and intact."""
    try:
        files = set(read_index(directory)["weight_map"].values())
    except CheckpointError:
        return False
    return bool(files) and all(safetensors_intact(os.path.join(directory, f)) for f in files)
