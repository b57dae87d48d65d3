"""The `activation_checkpointing` section's checks, and HF's names for it: `gradient_checkpointing: true`
(`activation_checkpointing: true` in transformers 5) means mode full, and of its
`gradient_checkpointing_kwargs` kiln reads `every_n_layers` (as `activation_checkpointing.every`) and
`use_reentrant: false` (what kiln does); anything else there is refused in one sentence. The checkpointing
itself is kiln.strategies.activation_checkpointing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.utils.errors import ConfigError

MODES = ("full", "selective")


def check(mode: str | None, every: int, ops: Sequence[str] | None) -> None:
    """One sentence for a bad mode, `every` or `ops` (`mode` None: full through HF's switch, or off)."""
    if mode is not None and mode not in MODES:
        raise ConfigError(f"activation_checkpointing.mode is {mode!r}; use full or selective.")
    if every < 1:
        raise ConfigError(f"activation_checkpointing.every is {every}; use 1 for every block, N for every N-th.")
    if ops is not None and mode != "selective":
        raise ConfigError(
            "activation_checkpointing.ops chooses what selective checkpointing keeps; set mode: selective "
            "or remove ops."
        )


def check_section(cfg: Any) -> None:
    """The section, with HF's switch and kwargs as they reach the tree."""
    section, train = cfg.activation_checkpointing, cfg.train
    check(section.mode, section.every, section.ops)
    if train.gradient_checkpointing and section.mode == "selective":
        raise ConfigError(
            "gradient_checkpointing: true means activation_checkpointing.mode full, but the mode is selective; "
            "drop gradient_checkpointing."
        )
    if train.gradient_checkpointing_kwargs:
        _check_kwargs(dict(train.gradient_checkpointing_kwargs), "train.gradient_checkpointing_kwargs")


def _check_kwargs(kwargs: dict[str, Any], name: str) -> None:
    if kwargs.get("use_reentrant"):
        raise ConfigError(
            f"{name} use_reentrant: true is not supported: kiln checkpoints non-reentrant (PyTorch's recommended "
            "form, which selective checkpointing and FSDP2 need; the gradients are the same); drop use_reentrant."
        )
    if "every_n_layers" in kwargs:
        raise ConfigError(f"{name} every_n_layers is activation_checkpointing.every in kiln; set that instead.")
    extra = sorted(set(kwargs) - {"use_reentrant"})
    if extra:
        raise ConfigError(
            f"{name} {', '.join(extra)} is not supported by kiln (it takes use_reentrant: false, and every_n_layers "
            "as activation_checkpointing.every); drop it."
        )


def hf_kwargs(name: str) -> Any:
    """The rewrite of HF's flat `name` (gradient_checkpointing_kwargs, activation_checkpointing_kwargs)."""

    def rewrite(value: Any) -> dict[str, Any]:
        if not value:
            return {}
        if isinstance(value, str):  # a JSON string, as on HF's command line
            import json

            try:
                value = json.loads(value)
            except ValueError:
                value = None
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a mapping, got {value!r}.")
        kwargs = dict(value)
        out: dict[str, Any] = {}
        if "every_n_layers" in kwargs:
            out["activation_checkpointing.every"] = kwargs.pop("every_n_layers")
        if "offload" in kwargs:
            raise ValueError(
                f"{name} offload is not supported by kiln (activations stay on the device); drop it, or use "
                "activation_checkpointing.mode selective to keep fewer of them."
            )
        _check_kwargs(kwargs, name)
        if kwargs:
            out["train.gradient_checkpointing_kwargs"] = kwargs
        return out

    return rewrite
