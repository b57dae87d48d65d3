"""What the Trainer's constructor receives: a config or HF's `args=`, and strategy / precision objects
travelling beside a dict config."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kiln.utils.errors import KilnError


def config_or_args(config: Any, args: Any) -> Any:
    """`args=` is HF's name for the settings (a TrainingArguments, or anything `config=` takes)."""
    if args is None:
        return config
    if config is not None:
        raise KilnError(
            "Trainer got both `config=` and `args=`; pass the settings once (args= is HF's name for config=)."
        )
    return args


def pop_objects(
    config: Any, strategy: Any, precision: Any, overrides: Iterable[str]
) -> tuple[Any, Any, Any, list[str]]:
    """Allow `{"strategy": MyStrategy(), ...}` in a dict config: objects travel beside the config.
    Names stay in the config, numbers and booleans too (`{"precision": 16}`: the config reads them);
    a name or number given as the `precision=` keyword becomes the config's (`precision="bf16"`, `16`),
    and so does a name given as the `strategy=` keyword (`strategy="deepspeed_stage_3"`): the config is
    read-only once loaded, and its saved copy names the strategy that ran."""
    overrides = list(overrides)
    if isinstance(strategy, str):
        overrides.append(f"strategy.name={strategy}")
        strategy = None
    if isinstance(precision, (str, int, float)) and not isinstance(precision, bool):
        overrides.append(f"precision={precision}")
        precision = None
    if isinstance(config, Mapping):
        config = dict(config)
        for key in ("strategy", "precision"):
            value = config.get(key)
            if value is not None and not isinstance(value, (str, Mapping, int, float)):
                config.pop(key)
                if key == "strategy":
                    strategy = strategy or value
                else:
                    precision = precision or value
    return config, strategy, precision, overrides
