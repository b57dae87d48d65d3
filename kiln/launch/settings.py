"""What a launcher asks of the run's settings, and how that meets the kiln config.

An accelerate configuration reaches kiln as a file (`kiln fit --accelerate-config FILE`) or as the
ACCELERATE_* / FSDP_* variables `accelerate launch` exports; both are read into one `AccelerateConfig`
(accelerate_config.py), and `settings_of` is the one place that says what it means in kiln config
keys. kiln's own launcher computes the settings once, from the file, and hands them to its workers as
an argument, not through variables of its own.

Precedence between a launcher and the kiln config: the launcher's value is used for a key only when
the user's own config does not set that key; when both set it and they differ, the kiln config
wins. Either way one line on rank 0 says which value won and where it came from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.config.hf.fsdp import SHARDING
from kiln.launch.accelerate_config import AccelerateConfig
from kiln.launch.environment import detect
from kiln.launch.environment.base import Env
from kiln.launch.environment.base import current as _env
from kiln.utils.truthy import truthy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LauncherSetting:
    """One thing a launcher asks for: `key` decides precedence, `values` are applied together."""

    key: str
    values: dict[str, Any]
    origin: str  # e.g. "ACCELERATE_MIXED_PRECISION=bf16"


_PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


def accelerate_settings(env: Env | None = None) -> list[LauncherSetting]:
    """What `accelerate launch` (its config file or flags, exported as ACCELERATE_* / FSDP_* variables)
    asks of the run, as kiln config keys; [] when accelerate did not start this process."""
    config = AccelerateConfig.from_env(_env(env))
    return [] if config is None else settings_of(config)


def settings_of(config: AccelerateConfig) -> list[LauncherSetting]:
    """An accelerate configuration (from its file or its variables) as kiln config keys. FSDP and
    DeepSpeed settings are handed over in Hugging Face's `fsdp` / `fsdp_config` / `deepspeed` format,
    which the FSDP and DeepSpeed strategies read."""
    out: list[LauncherSetting] = []
    mp = config.mixed_precision
    if mp in _PRECISIONS:
        out.append(
            LauncherSetting("precision.name", {"precision.name": _PRECISIONS[mp]}, f"ACCELERATE_MIXED_PRECISION={mp}")
        )
    elif mp and detect().rank == 0:
        log.warning(
            "accelerate launch asks for mixed precision %r (ACCELERATE_MIXED_PRECISION), which kiln does not "
            "provide; the kiln config's precision is used.",
            mp,
        )
    if config.use_cpu:
        out.append(LauncherSetting("strategy.device", {"strategy.device": "cpu"}, "ACCELERATE_USE_CPU=true"))
    if config.distributed_type == "FSDP":
        out.append(LauncherSetting("strategy.name", _fsdp_values(config.fsdp), "ACCELERATE_USE_FSDP=true"))
    elif config.distributed_type == "DEEPSPEED":
        out.append(
            LauncherSetting("strategy.name", _deepspeed_values(config.deepspeed), "ACCELERATE_USE_DEEPSPEED=true")
        )
    backend = config.dynamo_backend
    if backend:
        values: dict[str, Any] = {"train.torch_compile_backend": backend}
        if config.dynamo_mode:
            values["train.torch_compile_mode"] = config.dynamo_mode
        out.append(LauncherSetting("train.torch_compile_backend", values, f"ACCELERATE_DYNAMO_BACKEND={backend}"))
    return out


def _fsdp_values(fsdp: Mapping[str, str]) -> dict[str, Any]:
    raw = fsdp.get("sharding_strategy", "1").strip()
    if raw.isdigit():
        sharding = SHARDING[int(raw) - 1] if 1 <= int(raw) <= len(SHARDING) else "full_shard"
    else:
        sharding = raw.lower()
    flags = [sharding]
    if truthy(fsdp.get("offload_params")):
        flags.append("offload")
    policy = fsdp.get("auto_wrap_policy", "").upper()
    if policy in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"):
        flags.append("auto_wrap")
    fsdp_config: dict[str, Any] = {}
    if fsdp.get("version"):
        fsdp_config["version"] = int(fsdp["version"])
    if fsdp.get("transformer_layer_cls_to_wrap") and policy != "SIZE_BASED_WRAP":
        fsdp_config["transformer_layer_cls_to_wrap"] = [
            c.strip() for c in fsdp["transformer_layer_cls_to_wrap"].split(",") if c.strip()
        ]
    if policy == "SIZE_BASED_WRAP" and fsdp.get("min_num_params"):
        fsdp_config["min_num_params"] = int(fsdp["min_num_params"])
    if fsdp.get("backward_prefetch") and fsdp["backward_prefetch"].upper() != "NO_PREFETCH":
        fsdp_config["backward_prefetch"] = fsdp["backward_prefetch"].lower()
    if fsdp.get("state_dict_type"):
        fsdp_config["state_dict_type"] = fsdp["state_dict_type"].upper()
    # accelerate's command line always exports FSDP_RESHARD_AFTER_FORWARD (default true); only FSDP2
    # configs use it, FSDP1 ones say it with the sharding strategy (2 = SHARD_GRAD_OP: no reshard)
    fsdp2 = fsdp.get("version", "1").strip() == "2"
    for key in (
        "forward_prefetch",
        "use_orig_params",
        "cpu_ram_efficient_loading",
        "sync_module_states",
        "activation_checkpointing",
        *(("reshard_after_forward",) if fsdp2 else ()),
    ):
        value = fsdp.get(key)
        if value is not None and value.lower() in ("true", "false"):
            fsdp_config[key] = truthy(value)
    return {"strategy.name": "fsdp", "strategy.options.fsdp": flags, "strategy.options.fsdp_config": fsdp_config}


def _deepspeed_values(ds_config: Mapping[str, str]) -> dict[str, Any]:
    path = ds_config.get("deepspeed_config_file")
    if path and path.lower() != "none":
        return {"strategy.name": "deepspeed", "strategy.options.config": path}
    zero: dict[str, Any] = {"stage": int(ds_config.get("zero_stage", "2"))}
    for kind in ("optimizer", "param"):
        device = ds_config.get(f"offload_{kind}_device", "none").lower()
        if device not in ("", "none"):
            zero[f"offload_{kind}"] = {"device": device}
    ds: dict[str, Any] = {"zero_optimization": zero}
    if ds_config.get("gradient_accumulation_steps"):
        ds["gradient_accumulation_steps"] = int(ds_config["gradient_accumulation_steps"])
    clip = ds_config.get("gradient_clipping", "none").lower()
    if clip not in ("", "none"):
        ds["gradient_clipping"] = float(clip)
    return {"strategy.name": "deepspeed", "strategy.options.config": ds}


# -- precedence ------------------------------------------------------------------------------------
def explicit_keys(source: Any = None, overrides: Sequence[str] | Mapping[str, Any] = ()) -> set[str]:
    """Dotted config keys the user set: every key written in a dict, YAML file or `key=value`
    override (Hugging Face flat names translated); for a `TrainingConfig` object, every value that
    differs from its default (an object cannot say which of its defaults were typed)."""
    from omegaconf import OmegaConf

    from kiln.config.load import normalise, parse_dotlist
    from kiln.config.schema import TrainingConfig

    keys: set[str] = set()
    if isinstance(source, TrainingConfig):
        default = _flatten(OmegaConf.to_container(OmegaConf.structured(TrainingConfig), resolve=True))  # type: ignore[arg-type]
        given = _flatten(OmegaConf.to_container(OmegaConf.structured(source), resolve=True))  # type: ignore[arg-type]
        keys |= {k for k, v in given.items() if default.get(k, _MISSING) != v}
    elif isinstance(source, Mapping):
        keys |= set(_flatten(normalise(dict(source))))
    elif isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        loaded = OmegaConf.to_container(OmegaConf.load(os.fspath(source)), resolve=True)
        if isinstance(loaded, dict):
            keys |= set(_flatten(normalise(loaded)))  # type: ignore[arg-type]
    extra = overrides if isinstance(overrides, Mapping) else parse_dotlist(list(overrides))
    keys |= set(_flatten(normalise(dict(extra))))
    return keys


_MISSING = object()


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and path != "strategy.options":
            out.update(_flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def launcher_overrides(
    source: Any = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    config: Any = None,
    env: Env | None = None,
    settings: list[LauncherSetting] | None = None,
) -> dict[str, Any]:
    """Config overrides `{dotted.key: value}` that the launcher asks for and the user's config
    (`source` plus `overrides`, as handed to the Trainer or the CLI) leaves unset; `config` is the
    loaded config, used to name the winning value. Logs on rank 0 each setting that changes the run
    and each conflict the kiln config wins.

    A `DictConfig` source is a config kiln already loaded, with launcher settings already resolved
    (the CLI loads before it builds the Trainer): nothing is added to it a second time. `settings`
    given (kiln's own launcher hands them over) replace what the environment says."""
    from omegaconf import DictConfig

    settings = accelerate_settings(env) if settings is None else settings
    if not settings or isinstance(source, DictConfig):
        return {}
    explicit = explicit_keys(source, overrides)
    chosen: dict[str, Any] = {}
    talk = detect(env).rank == 0
    for setting in settings:
        current = _lookup(config, setting.key)
        wanted = setting.values[setting.key]
        # `strategy: auto` means "pick for me", so the launcher may pick
        if setting.key in explicit and not (setting.key == "strategy.name" and current == "auto"):
            if talk and current is not None and current != wanted:
                log.warning(
                    "accelerate launch asks for %s=%s (%s), but the kiln config sets %s=%s, which wins.",
                    setting.key,
                    wanted,
                    setting.origin,
                    setting.key,
                    current,
                )
            continue
        if talk and current != wanted:
            log.warning(
                "Using %s=%s from accelerate launch (%s); the kiln config does not set %s.",
                setting.key,
                wanted,
                setting.origin,
                setting.key,
            )
        chosen.update(setting.values)
    return chosen


def load_with_launcher_settings(
    source: Any = None, overrides: Sequence[str] | Mapping[str, Any] = (), settings: list[LauncherSetting] | None = None
) -> Any:
    """`load_config(source, overrides)`, then the launcher's settings for the keys the user left unset."""
    from kiln.config.load import load_config

    config = load_config(source, overrides)
    launched = launcher_overrides(source, overrides, config, settings=settings)
    return load_config(config, launched) if launched else config


def settings_to_json(settings: list[LauncherSetting]) -> str:
    """The settings as one command-line argument for kiln's workers."""
    import json

    return json.dumps([[s.key, s.values, s.origin] for s in settings])


def settings_from_json(text: str) -> list[LauncherSetting]:
    import json

    return [LauncherSetting(key, dict(values), origin) for key, values, origin in json.loads(text)]


def _lookup(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return node


# -- accelerate config files (`kiln fit --accelerate-config FILE`) ---------------------------------
def accelerate_config_settings(path: str) -> tuple[int, list[LauncherSetting], dict[str, str]]:
    """(num_processes, the kiln settings an `accelerate config` file asks for, the device variables
    the workers' torch must see): what `kiln fit --accelerate-config FILE` hands its workers."""
    config = AccelerateConfig.from_file(path)
    if config.num_machines > 1:
        raise ValueError(
            f"accelerate config {path!r} describes {config.num_machines} machines, but `kiln --nproc` starts "
            "processes on this machine only: run `accelerate launch` (or torchrun) on every node instead."
        )
    devices = {"CUDA_VISIBLE_DEVICES": config.gpu_ids} if config.gpu_ids is not None else {}
    return config.num_processes, settings_of(config), devices
