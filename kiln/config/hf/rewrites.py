"""Translations of the HF `TrainingArguments` names that do not map one-to-one onto a config key:
`accelerator_config` (and its flat legacy names), `debug`, `tpu_metrics_debug`, `use_mps_device`,
`include_for_metrics`, `train_sampling_strategy`, `ddp_static_graph`, Seq2Seq's `generation_config` and
`parallelism_config` (strategy model_parallel's mesh).

Each function takes the HF value and returns `{dotted.path: value}` entries for the tree (empty when
the value is HF's default); a value kiln cannot honour raises ValueError with one sentence."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from kiln.utils.truthy import truthy

Rewrite = Callable[[Any], dict[str, Any]]

DEBUG_OPTIONS = ("underflow_overflow", "tpu_metrics_debug")

# accelerate's AcceleratorConfig keys that concern a Trainer -> kiln key (None: accepted at its default only)
_ACCELERATOR_KEYS: dict[str, str] = {
    "split_batches": "data.split_batches",
    "dispatch_batches": "data.dispatch_batches",
    "even_batches": "data.even_batches",
    "use_seedable_sampler": "data.use_seedable_sampler",
}
# keys whose default is kiln's behaviour: accepted at that value, refused with the reason otherwise
_ACCELERATOR_FIXED: dict[str, tuple[Any, str]] = {
    "non_blocking": (None, "kiln already copies pinned batches to the device with non_blocking=True"),
    "gradient_accumulation_kwargs": (
        None,
        "use train.gradient_accumulation_steps; kiln always syncs gradients "
        "once per window and steps the scheduler once per optimizer step",
    ),
    "use_configured_state": (False, "kiln builds its own process group from the launcher's environment"),
}


def _optional_bool(path: str) -> Rewrite:
    """A boolean whose HF default is None ("decide for me"): None keeps kiln's default."""

    def rewrite(value: Any) -> dict[str, Any]:
        return {} if value is None else {path: truthy(value)}

    return rewrite


def use_mps_device(value: Any) -> dict[str, Any]:
    """HF's deprecated `use_mps_device: true` selects Apple's GPU: kiln's `mps` strategy."""
    return {"strategy.name": "mps"} if truthy(value) else {}


def debug(value: Any) -> dict[str, Any]:
    """HF's `debug` is a space-separated string or a list of DebugOption names."""
    if value is None or value == "" or value == []:
        return {}
    items = value.split() if isinstance(value, str) else [getattr(v, "value", v) for v in value]
    unknown = [v for v in items if v not in DEBUG_OPTIONS]
    if unknown:
        raise ValueError(f"debug={value!r} names unknown options {unknown}; choose from {', '.join(DEBUG_OPTIONS)}.")
    return {"train.debug": list(dict.fromkeys(items))}


def tpu_metrics_debug(value: Any) -> dict[str, Any]:
    """HF's older flag for `debug: tpu_metrics_debug`."""
    return {"train.debug": ["tpu_metrics_debug"]} if truthy(value) else {}


def _accelerator_mapping(value: Any) -> Mapping[str, Any]:
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not os.path.isfile(path):
            raise ValueError(f"accelerator_config {path!r} is neither an existing JSON file nor a mapping.")
        with open(path) as f:
            return json.load(f)
    if hasattr(value, "to_dict"):  # transformers' AcceleratorConfig dataclass
        return value.to_dict()
    if isinstance(value, Mapping):
        return value
    raise ValueError(f"accelerator_config must be a mapping or a JSON file path, not {type(value).__name__}.")


def accelerator_config(value: Any) -> dict[str, Any]:
    """accelerate's AcceleratorConfig: the data keys become `data.*`; the rest must hold their default."""
    if value is None or value == {}:
        return {}
    out: dict[str, Any] = {}
    for key, item in _accelerator_mapping(value).items():
        if key in _ACCELERATOR_KEYS:
            out.update(_optional_bool(_ACCELERATOR_KEYS[key])(item))
        elif key in _ACCELERATOR_FIXED:
            default, reason = _ACCELERATOR_FIXED[key]
            if item not in (default, False, None, {}):
                raise ValueError(f"accelerator_config {key}={item!r} is not supported: {reason}.")
        else:
            known = ", ".join([*_ACCELERATOR_KEYS, *_ACCELERATOR_FIXED])
            raise ValueError(f"accelerator_config has unknown key {key!r}; kiln reads {known}.")
    return out


def include_for_metrics(value: Any) -> dict[str, Any]:
    """HF's list form of include_inputs_for_metrics: 'inputs' passes the inputs to compute_metrics."""
    items = [value] if isinstance(value, str) else list(value or [])
    unknown = [v for v in items if v not in ("inputs", "loss")]
    if unknown:
        raise ValueError(f"include_for_metrics={value!r} names unknown entries {unknown}; use 'inputs' and/or 'loss'.")
    if "loss" in items:
        raise ValueError(
            "include_for_metrics 'loss' is not supported: kiln reports the loss as eval_loss; keep only 'inputs'."
        )
    return {"eval.include_inputs_for_metrics": True} if "inputs" in items else {}


def train_sampling_strategy(value: Any) -> dict[str, Any]:
    """HF's sampler choice: random (kiln's default) or group_by_length."""
    if value in (None, "random"):
        return {}
    if value == "group_by_length":
        return {"data.group_by_length": True}
    raise ValueError(f"train_sampling_strategy={value!r} is not supported; use 'random' or 'group_by_length'.")


#: accelerate's ParallelismConfig size field -> the axis of `strategy: model_parallel`'s mesh
PARALLELISM_SIZES = {"dp_replicate_size": "dp_replicate", "dp_shard_size": "dp_shard", "cp_size": "cp", "tp_size": "tp"}


def parallelism_config(value: Any) -> dict[str, Any]:
    """HF's `parallelism_config` (accelerate's ParallelismConfig, or a mapping with its `*_size` keys)
    selects `strategy: model_parallel` with the same mesh; sizes left unset are 1, as accelerate reads them."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        given = dict(value)
    elif all(hasattr(value, name) for name in PARALLELISM_SIZES):
        given = {name: getattr(value, name) for name in (*PARALLELISM_SIZES, "sp_size")}
    else:
        raise ValueError(
            f"parallelism_config={value!r} must be an accelerate ParallelismConfig or a mapping with "
            f"{', '.join(PARALLELISM_SIZES)}."
        )
    other = [k for k, v in given.items() if k not in PARALLELISM_SIZES and v not in (None, 1)]
    if other:
        raise ValueError(
            f"parallelism_config sets {', '.join(other)}, which kiln does not support; give only "
            f"{', '.join(PARALLELISM_SIZES)} (DeepSpeed sequence parallelism is not available)."
        )
    mesh = {PARALLELISM_SIZES[k]: int(v) for k, v in given.items() if k in PARALLELISM_SIZES and v is not None}
    return {"strategy.name": "model_parallel", "strategy.options.mesh": mesh}


def generation_config(value: Any) -> dict[str, Any]:
    """Seq2Seq's `generation_config` (a GenerationConfig or a dict) becomes generate() keyword arguments."""
    if value is None:
        return {}
    if hasattr(value, "to_diff_dict"):  # only what differs from GenerationConfig's defaults
        value = {k: v for k, v in value.to_diff_dict().items() if not k.startswith("_") and k != "transformers_version"}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"generation_config={value!r} must be a GenerationConfig or a dict; load a saved one with "
            "GenerationConfig.from_pretrained(path) first."
        )
    return {"eval.generation_kwargs": dict(value)}


REWRITES: dict[str, Rewrite] = {
    "use_mps_device": use_mps_device,
    "debug": debug,
    "tpu_metrics_debug": tpu_metrics_debug,
    "accelerator_config": accelerator_config,
    **{key: _optional_bool(path) for key, path in _ACCELERATOR_KEYS.items()},  # HF's older flat names
    "include_for_metrics": include_for_metrics,
    "train_sampling_strategy": train_sampling_strategy,
    "ddp_static_graph": _optional_bool("strategy.static_graph"),
    "generation_config": generation_config,
    "parallelism_config": parallelism_config,
}
