"""The FSDP strategy's settings, read from the three ways a user can ask for them, into one object.

- kiln-native: `strategy: {name: fsdp, sharding: full_shard, wrap: [GPT2Block], offload: false, ...}`
- HF TrainingArguments: `fsdp: "full_shard auto_wrap offload"` (-> `strategy.options.fsdp`) and
  `fsdp_config` (a mapping or a JSON file path; keys with or without the `fsdp_` prefix)
  (-> `strategy.options.fsdp_config`)
- `accelerate launch` with `distributed_type: FSDP` (environment.py turns its FSDP_* variables into
  the same `fsdp` / `fsdp_config` form).

Precedence: kiln-native keys win over `fsdp_config`, which wins over the `fsdp` flag string; a
conflict is logged once. Settings that FSDP2 has no equivalent for are accepted and logged once as
having no effect, so nothing is silently dropped."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kiln.config.fsdp_config import SHARDING, read_fsdp_config, sharding_name
from kiln.utils.errors import ConfigError
from kiln.utils.truthy import truthy

log = logging.getLogger(__name__)

STATE_DICT_TYPES = {"sharded": "sharded", "sharded_state_dict": "sharded", "full": "full", "full_state_dict": "full",
                    "local_state_dict": "sharded", "local": "sharded"}

#: HF / accelerate settings FSDP2 has no equivalent for -> why (logged once when set)
NO_EFFECT = {
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "limit_all_gathers": "FSDP2 limits in-flight all-gathers itself",
    "xla": "kiln's fsdp strategy runs on CPU and CUDA (use strategy: xla_fsdp on TPUs)",
    "xla_fsdp_grad_ckpt": "kiln's fsdp strategy runs on CPU and CUDA",
    "xla_fsdp_settings": "kiln's fsdp strategy runs on CPU and CUDA",
    "version": "kiln's fsdp strategy is always FSDP2 (fully_shard)",
}

#: kiln-native option -> help (the strategy's declared `options`, beside the HF forms)
NATIVE = {
    "sharding": f"one of {', '.join(SHARDING)} (default full_shard)",
    "wrap": "class names of the blocks each made one FSDP unit (HF: transformer_layer_cls_to_wrap); "
            "default: the model's _no_split_modules",
    "min_num_params": "wrap every submodule holding at least this many not-yet-wrapped parameters instead of by class",
    "offload": "keep parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy)",
    "offload_pin_memory": "pin the offloaded host memory (default: when the device is an accelerator; needs one)",
    "reshard_after_forward": "free the gathered parameters after forward (default: true for full_shard/hybrid_shard)",
    "shard_size": "processes per shard group for hybrid_shard (default: processes per node)",
    "state_dict_type": "checkpoint format: sharded (torch.distributed.checkpoint, default) or full (safetensors)",
    "activation_checkpointing": "recompute each wrapped block's activations in backward",
    "forward_prefetch": "all-gather the next block's parameters during the current block's forward",
    "backward_prefetch": "backward_pre (FSDP2's default) or backward_post (no effect in FSDP2)",
    "sync_module_states": "broadcast rank 0's parameters and buffers before sharding",
    "cpu_ram_efficient_loading": "a model the Trainer builds (model_init) is built on rank 0 only, the other ranks on "
                                 "the meta device, and rank 0's values are scattered into the shards (implies sync_module_states)",
    "use_orig_params": "(accepted; no effect in FSDP2)",
    "limit_all_gathers": "(accepted; no effect in FSDP2)",
    "version": "(accepted; kiln always uses FSDP2)",
    "fsdp": "HF `fsdp` flags: full_shard / shard_grad_op / no_shard / hybrid_shard / hybrid_shard_zero2 / offload / auto_wrap",
    "fsdp_config": "HF `fsdp_config`: a mapping or a JSON file path",
}


@dataclass
class FSDPSettings:
    sharding: str = "full_shard"
    wrap: Optional[list[str]] = None
    min_num_params: Optional[int] = None
    offload: bool = False
    #: None: pin when the device is an accelerator
    offload_pin_memory: Optional[bool] = None
    reshard_after_forward: Optional[bool] = None
    shard_size: Optional[int] = None
    state_dict_type: str = "sharded"
    activation_checkpointing: bool = False
    forward_prefetch: bool = False
    sync_module_states: bool = False
    cpu_ram_efficient_loading: bool = False
    #: settings given that have no effect (name -> why), logged once by the strategy
    no_effect: dict[str, str] = field(default_factory=dict)

    @property
    def reshard(self) -> bool:
        if self.reshard_after_forward is not None:
            return bool(self.reshard_after_forward)
        return self.sharding in ("full_shard", "hybrid_shard")


def _flags(value: Any) -> list[str]:
    if value is None or value is False:
        return []
    flags = value.split() if isinstance(value, str) else [str(v) for v in value]
    known = (*SHARDING, "offload", "auto_wrap")
    for flag in flags:
        if flag not in known:
            raise ConfigError(f"fsdp flag {flag!r} is not one of {', '.join(known)}; fix the `fsdp` argument.")
    return flags


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def resolve(option: Callable[[str], Any]) -> FSDPSettings:
    """Merge the flags, `fsdp_config` and the native options (`option(name)` returns None when unset)."""
    merged: dict[str, tuple[Any, str]] = {}

    def put(key: str, value: Any, source: str) -> None:
        if value is None:
            return
        if key in merged and merged[key][0] != value:
            log.info("FSDP setting %s: %s=%r overrides %s=%r.", key, source, value, merged[key][1], merged[key][0])
        merged[key] = (value, source)

    for flag in _flags(option("fsdp")):
        if flag in SHARDING:
            put("sharding", flag, "fsdp")
        elif flag == "offload":
            put("offload", True, "fsdp")
    cfg = read_fsdp_config(option("fsdp_config"), strict=True)
    for key, value in cfg.items():
        if key == "transformer_layer_cls_to_wrap":
            put("wrap", _names(value), "fsdp_config")
        elif key in ("sharding_strategy", "offload_params"):
            put("sharding" if key == "sharding_strategy" else "offload", value, "fsdp_config")
        else:
            put(key, value, "fsdp_config")
    for key in NATIVE:
        if key not in ("fsdp", "fsdp_config"):
            put(key, option(key), "strategy")
    s = FSDPSettings()
    for key, (value, _source) in merged.items():
        if key in NO_EFFECT:
            if truthy(value) or key == "version" and value not in (2, "2"):
                s.no_effect[key] = NO_EFFECT[key]
        elif key == "sharding":
            name = sharding_name(value)
            if name not in SHARDING:
                raise ConfigError(f"FSDP sharding {value!r} is not one of {', '.join(SHARDING)}; fix strategy.sharding.")
            s.sharding = name
        elif key == "wrap":
            s.wrap = _names(value) or None
        elif key == "min_num_params":
            s.min_num_params = int(value) or None
        elif key in ("offload", "activation_checkpointing", "forward_prefetch", "sync_module_states",
                     "cpu_ram_efficient_loading", "offload_pin_memory"):
            setattr(s, key, truthy(value))
        elif key in ("reshard_after_forward",):
            s.reshard_after_forward = truthy(value)
        elif key == "shard_size":
            s.shard_size = int(value)
        elif key == "state_dict_type":
            kind = STATE_DICT_TYPES.get(str(value).lower())
            if kind is None:
                raise ConfigError(f"FSDP state_dict_type {value!r} is not sharded or full; fix strategy.state_dict_type.")
            s.state_dict_type = kind
        elif key == "auto_wrap_policy":
            pass  # implied by wrap / min_num_params, which say what to wrap
        elif key == "backward_prefetch":
            if str(value).lower() in ("backward_post",):
                s.no_effect[key] = "FSDP2 prefetches the next block's parameters before backward (backward_pre) only"
        else:
            raise ConfigError(f"fsdp_config key {key!r} is not an FSDP setting kiln knows; known: "
                              f"{', '.join(sorted(k for k in NATIVE if k not in ('fsdp', 'fsdp_config')))}.")
    if s.wrap and s.min_num_params:
        raise ConfigError("FSDP wrap (transformer_layer_cls_to_wrap) and min_num_params are both set; set only one of them.")
    return s
