"""The optimizer under ZeRO-Offload: it steps on the CPU with DeepSpeed's own Adam, so kiln's Adam-family
settings become the DeepSpeed config's optimizer section (what HF users write by hand)."""

from __future__ import annotations

import logging
from typing import Any

from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    device = (ds.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
    return str(device).lower() not in ("none", "")


def ds_optimizer_from_kiln(cfg: Any) -> dict[str, Any]:
    """ZeRO-Offload steps on the CPU with DeepSpeed's own Adam: kiln's Adam-family settings become
    the DeepSpeed config's optimizer section (what HF users write by hand)."""
    name = str(cfg.optim.name).lower()
    if not name.startswith("adam"):
        raise ConfigError(
            f"ZeRO-Offload needs a DeepSpeed optimizer, and kiln's optim.name={cfg.optim.name!r} has none; "
            'add an "optimizer" section to the DeepSpeed config or use optim.name: adamw_torch.'
        )
    kind = "Adam" if name in ("adam", "adam_torch") else "AdamW"
    log.info("ZeRO-Offload: kiln's optimizer %r runs as DeepSpeed's %s (DeepSpeedCPUAdam).", cfg.optim.name, kind)
    return {
        "type": kind,
        "params": {
            "lr": float(cfg.optim.lr),
            "betas": [float(cfg.optim.adam_beta1), float(cfg.optim.adam_beta2)],
            "eps": float(cfg.optim.adam_epsilon),
            "weight_decay": float(cfg.optim.weight_decay),
        },
    }
