"""What a launcher asks of the run's settings, and how that meets the kiln config.

`accelerate launch` exports its config file or flags as ACCELERATE_* / FSDP_* variables; this module
turns them into kiln config keys (`accelerate_settings`). kiln's own launcher (`kiln fit
--accelerate-config FILE`) computes the same settings from the file and hands them to its workers as
an argument, not through variables of its own.

Precedence between a launcher and the kiln config: the launcher's value is used for a key only when
the user's own config does not set that key; when both set it and they differ, the kiln config
wins. Either way one line on rank 0 says which value won and where it came from.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

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
_SHARDING = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]


def accelerate_settings(env: Optional[Env] = None) -> list[LauncherSetting]:
    """What `accelerate launch` (its config file or flags, exported as ACCELERATE_* / FSDP_* variables)
    asks of the run, as kiln config keys. FSDP and DeepSpeed settings are handed over in Hugging
    Face's `fsdp` / `fsdp_config` / `deepspeed` format, which the FSDP and DeepSpeed strategies read."""
    env = _env(env)
    out: list[LauncherSetting] = []
    mp = env.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    if mp in _PRECISIONS:
        out.append(LauncherSetting("precision.name", {"precision.name": _PRECISIONS[mp]}, f"ACCELERATE_MIXED_PRECISION={mp}"))
    elif mp:
        log.warning("accelerate launch asks for mixed precision %r (ACCELERATE_MIXED_PRECISION), which kiln does not "
                    "provide; the kiln config's precision is used.", mp)
    if truthy(env.get("ACCELERATE_USE_CPU")):
        out.append(LauncherSetting("strategy.device", {"strategy.device": "cpu"}, "ACCELERATE_USE_CPU=true"))
    if truthy(env.get("ACCELERATE_USE_FSDP")):
        out.append(LauncherSetting("strategy.name", _fsdp_values(env), "ACCELERATE_USE_FSDP=true"))
    elif truthy(env.get("ACCELERATE_USE_DEEPSPEED")):
        out.append(LauncherSetting("strategy.name", _deepspeed_values(env), "ACCELERATE_USE_DEEPSPEED=true"))
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if backend not in ("", "no"):
        values: dict[str, Any] = {"train.torch_compile_backend": backend}
        mode = env.get("ACCELERATE_DYNAMO_MODE")
        if mode:
            values["train.torch_compile_mode"] = mode
        out.append(LauncherSetting("train.torch_compile_backend", values, f"ACCELERATE_DYNAMO_BACKEND={backend}"))
    return out


def _fsdp_values(env: Env) -> dict[str, Any]:
    raw = env.get("FSDP_SHARDING_STRATEGY", "1").strip()
    if raw.isdigit():
        sharding = _SHARDING[int(raw) - 1] if 1 <= int(raw) <= len(_SHARDING) else "full_shard"
    else:
        sharding = raw.lower()
    flags = [sharding]
    if truthy(env.get("FSDP_OFFLOAD_PARAMS")):
        flags.append("offload")
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "").upper()
    if policy in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"):
        flags.append("auto_wrap")
    cfg: dict[str, Any] = {}
    if env.get("FSDP_VERSION"):
        cfg["version"] = int(env["FSDP_VERSION"])
    if env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") and policy != "SIZE_BASED_WRAP":
        cfg["transformer_layer_cls_to_wrap"] = [c.strip() for c in env["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",") if c.strip()]
    if policy == "SIZE_BASED_WRAP" and env.get("FSDP_MIN_NUM_PARAMS"):
        cfg["min_num_params"] = int(env["FSDP_MIN_NUM_PARAMS"])
    if env.get("FSDP_BACKWARD_PREFETCH") and env["FSDP_BACKWARD_PREFETCH"].upper() != "NO_PREFETCH":
        cfg["backward_prefetch"] = env["FSDP_BACKWARD_PREFETCH"].lower()
    if env.get("FSDP_STATE_DICT_TYPE"):
        cfg["state_dict_type"] = env["FSDP_STATE_DICT_TYPE"].upper()
    # accelerate's command line always exports FSDP_RESHARD_AFTER_FORWARD (default true); only FSDP2
    # configs use it, FSDP1 ones say it with the sharding strategy (2 = SHARD_GRAD_OP: no reshard)
    fsdp2 = env.get("FSDP_VERSION", "1").strip() == "2"
    for key in ("forward_prefetch", "use_orig_params", "cpu_ram_efficient_loading", "sync_module_states",
                "activation_checkpointing", *(("reshard_after_forward",) if fsdp2 else ())):
        value = env.get(f"FSDP_{key.upper()}")
        if value is not None and value.lower() in ("true", "false"):
            cfg[key] = truthy(value)
    return {"strategy.name": "fsdp", "strategy.options.fsdp": flags, "strategy.options.fsdp_config": cfg}


def _deepspeed_values(env: Env) -> dict[str, Any]:
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and path.lower() != "none":
        return {"strategy.name": "deepspeed", "strategy.options.config": path}
    zero: dict[str, Any] = {"stage": int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))}
    for kind in ("optimizer", "param"):
        device = env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none").lower()
        if device not in ("", "none"):
            zero[f"offload_{kind}"] = {"device": device}
    ds: dict[str, Any] = {"zero_optimization": zero}
    if env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        ds["gradient_accumulation_steps"] = int(env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])
    clip = env.get("ACCELERATE_GRADIENT_CLIPPING", "none").lower()
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
    env: Optional[Env] = None,
    settings: Optional[list[LauncherSetting]] = None,
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
                log.warning("accelerate launch asks for %s=%s (%s), but the kiln config sets %s=%s, which wins.",
                            setting.key, wanted, setting.origin, setting.key, current)
            continue
        if talk and current != wanted:
            log.warning("Using %s=%s from accelerate launch (%s); the kiln config does not set %s.",
                        setting.key, wanted, setting.origin, setting.key)
        chosen.update(setting.values)
    return chosen


def load_with_launcher_settings(source: Any = None, overrides: Sequence[str] | Mapping[str, Any] = (),
                                settings: Optional[list[LauncherSetting]] = None) -> Any:
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
def accelerate_config_settings(path: str) -> tuple[int, list[Any], dict[str, str]]:
    """(num_processes, the kiln settings an `accelerate config` file asks for, the device variables
    the workers' torch must see): what `kiln fit --accelerate-config FILE` hands its workers."""
    num, env = accelerate_config_env(path)
    devices = {k: v for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES"}
    return num, accelerate_settings(env), devices


def accelerate_config_env(path: str) -> tuple[int, dict[str, str]]:
    """(num_processes, the variables `accelerate launch --config_file PATH` would export)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise ValueError(f"accelerate config {path!r} must hold a mapping.")
    if int(raw.get("num_machines", 1) or 1) > 1:
        raise ValueError(f"accelerate config {path!r} describes {raw['num_machines']} machines, but `kiln --nproc` starts "
                         "processes on this machine only: run `accelerate launch` (or torchrun) on every node instead.")
    env = {"ACCELERATE_MIXED_PRECISION": str(raw.get("mixed_precision") or "no").lower(),
           "ACCELERATE_USE_CPU": str(bool(raw.get("use_cpu", False))).lower()}
    kind = str(raw.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
        renamed = {"FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP": "FSDP_TRANSFORMER_CLS_TO_WRAP",
                   "FSDP_BACKWARD_PREFETCH_POLICY": "FSDP_BACKWARD_PREFETCH"}
        for key, value in (raw.get("fsdp_config") or {}).items():
            name = key.upper() if key.upper().startswith("FSDP_") else f"FSDP_{key.upper()}"
            env[renamed.get(name, name)] = str(value).lower() if isinstance(value, bool) else str(value)
    elif kind == "DEEPSPEED":
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        names = {"deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE", "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                 "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                 "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                 "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                 "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING"}
        env.update({names[k]: str(v) for k, v in (raw.get("deepspeed_config") or {}).items() if k in names and v is not None})
    dynamo = raw.get("dynamo_config") or {}
    if dynamo.get("dynamo_backend"):
        env["ACCELERATE_DYNAMO_BACKEND"] = str(dynamo["dynamo_backend"]).upper()
        if dynamo.get("dynamo_mode"):
            env["ACCELERATE_DYNAMO_MODE"] = str(dynamo["dynamo_mode"])
    gpu_ids = raw.get("gpu_ids")
    if gpu_ids not in (None, "", "all") and not raw.get("use_cpu"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    return int(raw.get("num_processes") or 1), env
