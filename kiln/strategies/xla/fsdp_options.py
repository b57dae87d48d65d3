"""The `xla_fsdp` strategy's settings, from kiln's own keys or HF's `fsdp` / `fsdp_config` forms.

- kiln-native: `strategy: {name: xla_fsdp, wrapper: spmd, wrap: [Block], activation_checkpointing: true}`
- HF: `fsdp: full_shard` + `fsdp_config: {xla: true, xla_fsdp_v2: ..., xla_fsdp_settings: {...},
  xla_fsdp_grad_ckpt: ..., transformer_layer_cls_to_wrap: [...], min_num_params: N}`
  (kiln.config.hf.xla routes that pair here).

`wrapper`: `spmd` (default; HF `xla_fsdp_v2: true`) is SPMD FSDPv2, one process over every device;
`classic` (HF `xla_fsdp_v2: false`) is torch_xla's XlaFullyShardedDataParallel, one process per
device, configured by `settings` (HF `xla_fsdp_settings`, the wrapper's keyword arguments).
Note: HF's own default is the classic wrapper; kiln's is SPMD, which torch_xla recommends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.config.hf.fsdp import class_names, xla_fsdp_options
from kiln.utils.errors import ConfigError
from kiln.utils.truthy import truthy

WRAPPERS = ("spmd", "classic")

#: kiln-native option -> help (the strategy's declared `options`, beside the HF forms)
OPTIONS = {
    "wrapper": "spmd (SPMD FSDPv2 over every device in one process, default) or classic (XlaFullyShardedDataParallel)",
    "wrap": "class names of the blocks each made one FSDP unit (HF: transformer_layer_cls_to_wrap); "
    "default: the model's _no_split_modules",
    "min_num_params": "wrap every submodule holding at least this many not-yet-wrapped parameters instead of by class",
    "activation_checkpointing": "recompute each wrapped block in backward (HF: xla_fsdp_grad_ckpt); needs an auto-wrap policy",
    "settings": "keyword arguments of the classic wrapper (HF: xla_fsdp_settings); compute_dtype/buffer_dtype by name",
    "fsdp": "HF `fsdp` flags: full_shard / shard_grad_op / auto_wrap",
    "fsdp_config": "HF `fsdp_config` with xla: true: a mapping or a JSON file path",
}


@dataclass
class XLAFSDPSettings:
    wrapper: str = "spmd"
    wrap: list[str] | None = None
    min_num_params: int | None = None
    activation_checkpointing: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    #: settings given that have no effect here (name -> why), logged once by the strategy
    no_effect: dict[str, str] = field(default_factory=dict)


def resolve(option: Callable[[str], Any]) -> XLAFSDPSettings:
    """Merge the HF forms (kiln.config.hf.fsdp) and the native options (`option(name)` returns None when
    unset); native wins."""
    merged, no_effect = xla_fsdp_options(option("fsdp"), option("fsdp_config"))
    for key in ("wrapper", "wrap", "min_num_params", "activation_checkpointing", "settings"):
        if option(key) is not None:
            merged[key] = option(key)
    s = XLAFSDPSettings(no_effect=no_effect)
    s.wrapper = str(merged.get("wrapper", "spmd")).lower()
    if s.wrapper not in WRAPPERS:
        raise ConfigError(
            f"strategy.wrapper {merged['wrapper']!r} is not one of {', '.join(WRAPPERS)}; fix strategy.wrapper."
        )
    s.wrap = class_names(merged["wrap"]) or None if merged.get("wrap") else None
    s.min_num_params = int(merged.get("min_num_params") or 0) or None
    s.activation_checkpointing = truthy(merged.get("activation_checkpointing", False))
    s.settings = dict(merged.get("settings") or {})
    if s.wrap and s.min_num_params:
        raise ConfigError(
            "XLA FSDP wrap (transformer_layer_cls_to_wrap) and min_num_params are both set; set only one of them."
        )
    if s.settings and s.wrapper == "spmd":
        raise ConfigError(
            "xla_fsdp_settings (strategy.settings) configure the classic XLA FSDP wrapper, but SPMD FSDPv2 "
            "is chosen; set xla_fsdp_v2: false (strategy.wrapper: classic) or drop the settings."
        )
    return s


def check_activation_checkpointing(s: XLAFSDPSettings, has_policy: bool) -> None:
    """HF: xla_fsdp_grad_ckpt works on the auto-wrapped blocks, so it needs a policy that finds some."""
    if s.activation_checkpointing and not has_policy:
        raise ConfigError(
            "xla_fsdp_grad_ckpt (strategy.activation_checkpointing) needs an auto-wrap policy: set "
            "transformer_layer_cls_to_wrap (strategy.wrap) or min_num_params, or give the model _no_split_modules."
        )
