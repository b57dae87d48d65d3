"""Settings that ask for different values of one key, refused in one sentence instead of the later
one winning silently: two HF names (`fp16` with `bf16`, checked as the flat names are rewritten, in
kiln.config.load), and an explicit `strategy` against HF's arguments that pick a strategy themselves
(`deepspeed`, `fsdp`, `fsdp_config`, `parallelism_config`, `use_mps_device`), checked here once every key
of the config is read, so that the order the keys come in does not matter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.config.names import STRATEGY_GROUPS
from kiln.utils.errors import ConfigError

#: HF argument -> the strategy it asks for (`fsdp_config` and the older `fsdp_*` keys configure FSDP
#: without naming it: alone, with `strategy: auto`, they leave the name as it is)
HF_STRATEGY_ARGS: dict[str, str] = {
    "deepspeed": "deepspeed",
    "fsdp": "fsdp",
    "fsdp_config": "fsdp",
    "fsdp_min_num_params": "fsdp",
    "fsdp_transformer_layer_cls_to_wrap": "fsdp",
    "parallelism_config": "model_parallel",
    "use_mps_device": "mps",
}
_CONFIGURES_ONLY = ("fsdp_config", "fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap")


def _family(name: str) -> tuple[str, ...]:
    """The strategy names that agree with HF's choice `name`: its registry group (the DeepSpeed stage
    presets, `fsdp2`), and for FSDP also `xla_fsdp`, which reads HF's `fsdp` / `fsdp_config` too."""
    group = next((names for names in STRATEGY_GROUPS if name in names), (name,))
    return (*group, "xla_fsdp") if name == "fsdp" else group


def different(first: str, first_value: Any, second: str, second_value: Any, path: str, a: Any, b: Any) -> ConfigError:
    """The one sentence for two settings that set `path` to different values `a` and `b`."""
    return ConfigError(
        f"{first}={first_value!r} and {second}={second_value!r} ask for different {path} ({a!r} vs {b!r}); "
        "keep one of them."
    )


def explicit_strategy(key: str, value: Any) -> tuple[str, Any, Any] | None:
    """(key, value, name) when this raw config entry names the strategy (`strategy: fsdp`, `strategy:
    {name: fsdp}`, `strategy.name: fsdp`), else None."""
    if key == "strategy" and isinstance(value, str):
        return key, value, value
    if key == "strategy" and isinstance(value, Mapping) and value.get("name") is not None:
        return key, dict(value), value["name"]
    if key == "strategy.name" and value is not None:
        return key, value, value
    return None


def settle_strategy(tree: dict[str, Any], explicit: tuple[str, Any, Any] | None, picks: list[tuple[str, Any]]) -> None:
    """Refuse an explicit strategy (other than `auto`) that an HF argument in `picks` ((name, value)
    pairs that asked for something) contradicts, and HF arguments that contradict each other; else
    set `tree`'s strategy name: the explicit one (a preset such as `deepspeed_stage_3` stays), or under
    `auto` (or none) the one the HF arguments pick."""
    if not picks:
        return
    key, value = picks[0]
    for other, other_value in picks[1:]:
        if HF_STRATEGY_ARGS[other] not in _family(HF_STRATEGY_ARGS[key]):
            raise different(
                key, value, other, other_value, "strategy.name", HF_STRATEGY_ARGS[key], HF_STRATEGY_ARGS[other]
            )
    node = tree.setdefault("strategy", {})
    if explicit is None or explicit[2] == "auto":
        named = [HF_STRATEGY_ARGS[k] for k, _ in picks if k not in _CONFIGURES_ONLY]
        if named:
            node["name"] = named[0]
        return
    given, given_value, name = explicit
    for key, value in picks:
        if name not in _family(HF_STRATEGY_ARGS[key]):
            raise different(given, given_value, key, value, "strategy.name", name, HF_STRATEGY_ARGS[key])
    node["name"] = name
