"""Hugging Face's FSDP dialect: the sharding strategies by name and number, the one reader of
`fsdp_config` (a mapping or a JSON file path, keys with or without the `fsdp_` prefix), and the
translation of TrainingArguments' `fsdp` flag string and `fsdp_config` into the option names of kiln's
FSDP strategies.

Read by the CPU/CUDA `fsdp` strategy (strictly: anything but a mapping or an existing JSON file is an
error there), by the routing of `fsdp_config: {xla: true}` to `xla_fsdp` and by the XLA FSDP options
(leniently: what is not a mapping is left to the strategy's own checks, which name the problem)."""

from __future__ import annotations

import json
import os
from typing import Any

from kiln.utils.errors import ConfigError
from kiln.utils.truthy import truthy

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
                raise ConfigError(
                    f"fsdp_config {value!r} is neither a mapping nor an existing JSON file; pass a dict or a file path."
                )
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
    return {(str(k)[len("fsdp_") :] if str(k).startswith("fsdp_") else str(k)): v for k, v in dict(value).items()}


def class_names(value: Any) -> list[str]:
    """Class names given as a list or as one comma-separated string (HF's `transformer_layer_cls_to_wrap`
    takes both), stripped."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def _flags(value: Any, known: tuple[str, ...], refusal: str) -> list[str]:
    """HF's `fsdp` argument (a space-separated string or a list) as its flags; `refusal` (formatted with
    the flag and the known ones) for one that is not in `known`."""
    if value is None or value is False:
        return []
    flags = value.split() if isinstance(value, str) else [str(v) for v in value]
    for flag in flags:
        if flag not in known:
            raise ConfigError(refusal.format(flag=flag, known=", ".join(known)))
    return flags


def fsdp_options(fsdp: Any, fsdp_config: Any) -> list[tuple[str, Any, str]]:
    """HF's `fsdp` flags and `fsdp_config` for the CPU/CUDA fsdp strategy, as (kiln option, value, HF
    argument) in the order they apply (a later one overrides an earlier one): the flags, then
    `fsdp_config` (read strictly), whose keys keep their names except the three HF renames."""
    out: list[tuple[str, Any, str]] = []
    for flag in _flags(
        fsdp, (*SHARDING, "offload", "auto_wrap"), "fsdp flag {flag!r} is not one of {known}; fix the `fsdp` argument."
    ):
        if flag in SHARDING:
            out.append(("sharding", flag, "fsdp"))
        elif flag == "offload":
            out.append(("offload", True, "fsdp"))
    renamed = {"sharding_strategy": "sharding", "offload_params": "offload"}
    for key, value in read_fsdp_config(fsdp_config, strict=True).items():
        if key == "transformer_layer_cls_to_wrap":
            out.append(("wrap", class_names(value), "fsdp_config"))
        else:
            out.append((renamed.get(key, key), value, "fsdp_config"))
    return out


#: the `fsdp` flags XLA FSDP takes
XLA_FLAGS = ("full_shard", "shard_grad_op", "auto_wrap")
#: fsdp_config keys that only the CUDA/CPU FSDP strategy reads; accepted and said to have no effect
XLA_IGNORED = {
    "version",
    "use_orig_params",
    "limit_all_gathers",
    "backward_prefetch",
    "forward_prefetch",
    "sync_module_states",
    "cpu_ram_efficient_loading",
    "auto_wrap_policy",
    "state_dict_type",
}


def xla_fsdp_options(fsdp: Any, fsdp_config: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """HF's `fsdp` flags and `fsdp_config` (read leniently) for the xla_fsdp strategy: its options by
    kiln's names, and the settings given that have no effect there (name -> why)."""
    merged: dict[str, Any] = {}
    for flag in _flags(
        fsdp,
        XLA_FLAGS,
        "fsdp flag {flag!r} is not available with XLA FSDP (it takes {known}); fix the `fsdp` argument.",
    ):
        if flag == "shard_grad_op":
            merged.setdefault("settings", {})["reshard_after_forward"] = False
    no_effect: dict[str, str] = {}
    for key, value in read_fsdp_config(fsdp_config, strict=False).items():
        if key == "xla":
            continue
        if key == "xla_fsdp_v2":
            merged["wrapper"] = "spmd" if truthy(value) else "classic"
        elif key == "xla_fsdp_settings":
            merged["settings"] = {**merged.get("settings", {}), **dict(value or {})}
        elif key == "xla_fsdp_grad_ckpt":
            merged["activation_checkpointing"] = value
        elif key == "transformer_layer_cls_to_wrap":
            merged["wrap"] = value
        elif key in ("min_num_params", "activation_checkpointing"):
            merged[key] = value
        elif key in XLA_IGNORED:
            no_effect[key] = "it is a setting of the CPU/CUDA fsdp strategy"
        else:
            raise ConfigError(
                f"fsdp_config key {key!r} is not an XLA FSDP setting; known: xla, xla_fsdp_v2, "
                "xla_fsdp_settings, xla_fsdp_grad_ckpt, transformer_layer_cls_to_wrap, min_num_params."
            )
    return merged, no_effect
