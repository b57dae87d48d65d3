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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.config.hf.fsdp import SHARDING, fsdp_options, sharding_name
from kiln.strategies.mesh.settings import SHARED, MeshSettings, check_shared, set_shared
from kiln.utils.errors import ConfigError
from kiln.utils.truthy import truthy

log = logging.getLogger(__name__)

#: HF / accelerate settings FSDP2 has no equivalent for -> why (logged once when set)
NO_EFFECT = {
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "limit_all_gathers": "FSDP2 limits in-flight all-gathers itself",
    "xla": "kiln's fsdp strategy runs on CPU and CUDA (use strategy: xla_fsdp on TPUs)",
    "xla_fsdp_grad_ckpt": "kiln's fsdp strategy runs on CPU and CUDA",
    "xla_fsdp_settings": "kiln's fsdp strategy runs on CPU and CUDA",
    "version": "kiln's fsdp strategy is always FSDP2 (fully_shard)",
}

#: kiln-native option -> help (the strategy's declared `options`, beside the HF forms): the mesh
#: strategy's shared settings plus how the fsdp preset writes its mesh
NATIVE = {
    "sharding": f"one of {', '.join(SHARDING)} (default full_shard): the mesh full_shard / shard_grad_op "
    "{dp_shard: N}, no_shard {dp_replicate: N}, hybrid_shard(_zero2) {dp_replicate: N / shard_size, "
    "dp_shard: shard_size}",
    "shard_size": "processes per shard group for hybrid_shard (default: processes per node; with tp, data-parallel "
    "ranks per shard group)",
    "tp": "tensor-parallel size: the mesh gains a tp axis of this size and the sharding option takes the rest "
    "(full_shard: {dp_shard: N / tp, tp}); default 1",
    **SHARED,
    "backward_prefetch": "backward_pre (FSDP2's default) or backward_post (no effect in FSDP2)",
    "use_orig_params": "(accepted; no effect in FSDP2)",
    "limit_all_gathers": "(accepted; no effect in FSDP2)",
    "version": "(accepted; kiln always uses FSDP2)",
    "fsdp": "HF `fsdp` flags: full_shard / shard_grad_op / no_shard / hybrid_shard / hybrid_shard_zero2 / offload / auto_wrap",
    "fsdp_config": "HF `fsdp_config`: a mapping or a JSON file path",
}


@dataclass
class FSDPSettings(MeshSettings):
    sharding: str = "full_shard"
    shard_size: int | None = None
    tp: int = 1
    #: settings given that have no effect (name -> why), logged once by the strategy
    no_effect: dict[str, str] = field(default_factory=dict)

    @property
    def reshard(self) -> bool:
        if self.reshard_after_forward is not None:
            return bool(self.reshard_after_forward)
        return self.sharding in ("full_shard", "hybrid_shard")


def resolve(option: Callable[[str], Any]) -> FSDPSettings:
    """Merge the flags, `fsdp_config` and the native options (`option(name)` returns None when unset)."""
    merged: dict[str, tuple[Any, str]] = {}

    def put(key: str, value: Any, source: str) -> None:
        if value is None:
            return
        if key in merged and merged[key][0] != value:
            log.info("FSDP setting %s: %s=%r overrides %s=%r.", key, source, value, merged[key][1], merged[key][0])
        merged[key] = (value, source)

    for key, value, source in fsdp_options(option("fsdp"), option("fsdp_config")):  # HF's forms, kiln's names
        put(key, value, source)
    for key in NATIVE:
        if key not in ("fsdp", "fsdp_config"):
            put(key, option(key), "strategy")
    s = FSDPSettings()
    for key, (value, _source) in merged.items():
        if key in NO_EFFECT:
            # version asks for what kiln lacks unless it is FSDP2; the others when switched on
            if (value not in (2, "2")) if key == "version" else truthy(value):
                s.no_effect[key] = NO_EFFECT[key]
        elif key == "sharding":
            name = sharding_name(value)
            if name not in SHARDING:
                raise ConfigError(
                    f"FSDP sharding {value!r} is not one of {', '.join(SHARDING)}; fix strategy.sharding."
                )
            s.sharding = name
        elif key in ("shard_size", "tp"):
            setattr(s, key, int(value))
        elif key == "auto_wrap_policy":
            pass  # implied by wrap / min_num_params, which say what to wrap
        elif key == "backward_prefetch":
            if str(value).lower() in ("backward_post",):
                s.no_effect[key] = "FSDP2 prefetches the next block's parameters before backward (backward_pre) only"
        elif not set_shared(s, key, value):
            raise ConfigError(
                f"fsdp_config key {key!r} is not an FSDP setting kiln knows; known: "
                f"{', '.join(sorted(k for k in NATIVE if k not in ('fsdp', 'fsdp_config')))}."
            )
    check_shared(s)
    return s
