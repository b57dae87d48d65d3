"""HF's way of asking for XLA FSDP: `fsdp: full_shard` plus `fsdp_config: {xla: true, ...}`.

The two arguments are translated one by one (`fsdp` -> strategy fsdp, `fsdp_config` -> its options);
this pass, run on the translated tree, routes the pair to `strategy: xla_fsdp` when `fsdp_config`
says `xla: true`, and refuses the XLA-only keys without it (HF documents they need `xla: true`)."""

from __future__ import annotations

from typing import Any

from kiln.config.hf.fsdp import read_fsdp_config
from kiln.utils.errors import ConfigError
from kiln.utils.truthy import truthy

XLA_ONLY = ("xla_fsdp_v2", "xla_fsdp_settings", "xla_fsdp_grad_ckpt")


def route_xla_fsdp(tree: dict[str, Any]) -> None:
    """`strategy: fsdp` whose fsdp_config has `xla: true` becomes `strategy: xla_fsdp` (in place)."""
    strategy = tree.get("strategy")
    if not isinstance(strategy, dict) or strategy.get("name") != "fsdp":
        return
    cfg = read_fsdp_config((strategy.get("options") or {}).get("fsdp_config"), strict=False)
    if truthy(cfg.get("xla", False)):
        strategy["name"] = "xla_fsdp"
        return
    for key in XLA_ONLY:
        if key in cfg and truthy(cfg[key]):
            raise ConfigError(
                f'fsdp_config {key!r} applies to XLA FSDP only; add "xla": true to fsdp_config '
                f"(strategy xla_fsdp), or drop {key}."
            )
