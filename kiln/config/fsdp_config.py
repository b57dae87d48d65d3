"""Hugging Face's FSDP settings as data: the sharding strategies by name and number, and the one
reader of `fsdp_config` (a mapping or a JSON file path, keys with or without the `fsdp_` prefix).

Read by the CPU/CUDA `fsdp` strategy (strictly: anything but a mapping or an existing JSON file is an
error there), by the routing of `fsdp_config: {xla: true}` to `xla_fsdp` and by the XLA FSDP options
(leniently: what is not a mapping is left to the strategy's own checks, which name the problem)."""

from __future__ import annotations

import json
import os
from typing import Any

from kiln.utils.errors import ConfigError

#: FSDP's sharding strategies, in the order of HF's / accelerate's numbering (1 = full_shard)
SHARDING = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")


def sharding_name(value: Any) -> str:
    """A sharding strategy given by name (any case) or by HF's number ("1".."5"), as a lower-case name;
    an unknown value comes back as given, lower-cased, for the caller to refuse or replace."""
    text = str(value).strip()
    if text.isdigit() and 1 <= int(text) <= len(SHARDING):
        return SHARDING[int(text) - 1]
    return text.lower()


def read_fsdp_config(value: Any, *, strict: bool) -> dict[str, Any]:
    """`fsdp_config` as a dict with the `fsdp_` prefixes dropped. None or "" is empty. A string names
    a JSON file (invalid JSON is always an error). Anything else that is not a mapping, or a string
    that is no file, is an error when `strict`, and empty otherwise."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        if not os.path.isfile(value):
            if strict:
                raise ConfigError(f"fsdp_config {value!r} is neither a mapping nor an existing JSON file; "
                                  "pass a dict or a file path.")
            return {}
        with open(value, encoding="utf-8") as fh:
            try:
                value = json.load(fh)
            except json.JSONDecodeError as err:
                raise ConfigError(f"fsdp_config file {value!r} is not valid JSON ({err}); fix the file.") from None
    if not hasattr(value, "items"):
        if strict:
            raise ConfigError(f"fsdp_config must be a mapping or a JSON file path, got {type(value).__name__}.")
        return {}
    return {(str(k)[len("fsdp_"):] if str(k).startswith("fsdp_") else str(k)): v for k, v in dict(value).items()}


def class_names(value: Any) -> list[str]:
    """Class names given as a list or as one comma-separated string (HF's `transformer_layer_cls_to_wrap`
    takes both), stripped."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]
