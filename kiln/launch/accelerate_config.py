"""What an accelerate configuration asks for, in one structure, from either place it can come from:
the YAML file `accelerate config` writes (`kiln fit --accelerate-config FILE`), or the ACCELERATE_* /
FSDP_* variables `accelerate launch` exports to the processes it starts. Both readers fill the same
`AccelerateConfig`, which `kiln.launch.settings` turns into kiln config keys; nothing here knows kiln's
config. Values stay as accelerate spells them (text, as in its variables), so the two readers agree
by construction and the meaning is decided in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.utils.truthy import truthy

Env = Mapping[str, str]

# accelerate's variable names that differ from the config file's keys (without the fsdp_ prefix)
_FSDP_RENAMED = {
    "transformer_cls_to_wrap": "transformer_layer_cls_to_wrap",
    "backward_prefetch_policy": "backward_prefetch",
}
_DEEPSPEED_VARIABLES = {
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
}


@dataclass(frozen=True)
class AccelerateConfig:
    """An accelerate configuration, as text the way `accelerate launch` exports it.

    `fsdp` holds the `fsdp_config` entries under the config file's names without the `fsdp_` prefix
    (`sharding_strategy`, `transformer_layer_cls_to_wrap`, ...); `deepspeed` the `deepspeed_config`
    entries kiln reads (`deepspeed_config_file`, `zero_stage`, offload devices, accumulation, clipping)."""

    mixed_precision: str = ""  # no | fp16 | bf16 | fp8; "" when not given
    use_cpu: bool = False
    distributed_type: str = "NO"  # FSDP | DEEPSPEED | MULTI_GPU | ... (upper case)
    fsdp: Mapping[str, str] = field(default_factory=dict)
    deepspeed: Mapping[str, str] = field(default_factory=dict)
    dynamo_backend: str = ""  # lower case; "" when not compiled (accelerate's "no")
    dynamo_mode: str = ""
    num_processes: int = 1
    num_machines: int = 1
    gpu_ids: str | None = None  # CUDA_VISIBLE_DEVICES for the workers; None: every GPU

    @classmethod
    def from_env(cls, env: Env) -> AccelerateConfig | None:
        """The configuration `accelerate launch` exported into `env`; None when it did not start us."""
        if not any(k.startswith("ACCELERATE_") for k in env):
            return None
        kind = (
            "FSDP"
            if truthy(env.get("ACCELERATE_USE_FSDP"))
            else "DEEPSPEED"
            if truthy(env.get("ACCELERATE_USE_DEEPSPEED"))
            else "NO"
        )
        fsdp = {}
        for name, value in env.items():
            if name.startswith("FSDP_"):
                key = name[len("FSDP_") :].lower()
                fsdp[_FSDP_RENAMED.get(key, key)] = value
        deepspeed = {key: env[name] for key, name in _DEEPSPEED_VARIABLES.items() if name in env}
        return cls(
            mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "").strip().lower(),
            use_cpu=truthy(env.get("ACCELERATE_USE_CPU")),
            distributed_type=kind,
            fsdp=fsdp,
            deepspeed=deepspeed,
            dynamo_backend=_backend(env.get("ACCELERATE_DYNAMO_BACKEND")),
            dynamo_mode=env.get("ACCELERATE_DYNAMO_MODE", ""),
        )

    @classmethod
    def from_file(cls, path: str) -> AccelerateConfig:
        """The configuration in an `accelerate config` YAML file."""
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        if not isinstance(raw, dict):
            raise ValueError(f"accelerate config {path!r} must hold a mapping.")
        fsdp = {}
        for key, value in (raw.get("fsdp_config") or {}).items():
            key = key.lower().removeprefix("fsdp_")
            fsdp[_FSDP_RENAMED.get(key, key)] = _text(value)
        deepspeed = {
            k: _text(v)
            for k, v in (raw.get("deepspeed_config") or {}).items()
            if k in _DEEPSPEED_VARIABLES and v is not None
        }
        dynamo = raw.get("dynamo_config") or {}
        gpu_ids = raw.get("gpu_ids")
        return cls(
            mixed_precision=str(raw.get("mixed_precision") or "no").lower(),
            use_cpu=bool(raw.get("use_cpu", False)),
            distributed_type=str(raw.get("distributed_type", "NO")).upper(),
            fsdp=fsdp,
            deepspeed=deepspeed,
            dynamo_backend=_backend(dynamo.get("dynamo_backend")),
            dynamo_mode=str(dynamo.get("dynamo_mode") or ""),
            num_processes=int(raw.get("num_processes") or 1),
            num_machines=int(raw.get("num_machines", 1) or 1),
            gpu_ids=None if gpu_ids in (None, "", "all") or raw.get("use_cpu") else str(gpu_ids),
        )


def _text(value: Any) -> str:
    """A config file value as accelerate exports it: booleans in lower case, the rest as str()."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _backend(value: Any) -> str:
    text = str(value or "").strip().lower()
    return "" if text == "no" else text
