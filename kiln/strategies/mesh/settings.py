"""The settings both presets of the mesh strategy take (`strategy: fsdp` and `strategy: model_parallel`),
one dataclass with one reading of each key. What a preset adds is how the mesh is written (fsdp:
`sharding`, `shard_size`, `tp`, and HF's `fsdp` / `fsdp_config` forms; model_parallel: `mesh`); every
feature below means the same under both, or is refused under both in the same sentence
(MeshStrategy._check_settings)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.config.hf.fsdp import class_names
from kiln.utils.errors import ConfigError
from kiln.utils.truthy import truthy

STATE_DICT_TYPES = {
    "sharded": "sharded",
    "sharded_state_dict": "sharded",
    "full": "full",
    "full_state_dict": "full",
    "local_state_dict": "sharded",
    "local": "sharded",
}

#: the options both presets take -> help (part of each preset's declared `options`)
SHARED = {
    "wrap": "class names of the blocks each made one FSDP unit (HF: transformer_layer_cls_to_wrap); "
    "default: the model's _no_split_modules",
    "min_num_params": "wrap every submodule holding at least this many not-yet-wrapped parameters instead of by class",
    "offload": "keep parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy); needs FSDP, i.e. a "
    "mesh that is not tensor parallel alone",
    "offload_pin_memory": "pin the offloaded host memory (default: when the device is an accelerator; needs one)",
    "reshard_after_forward": "free the gathered parameters after forward (default true; fsdp: false for "
    "shard_grad_op and hybrid_shard_zero2)",
    "state_dict_type": "checkpoint format: sharded (torch.distributed.checkpoint, default) or full (safetensors)",
    "activation_checkpointing": "true: the config's activation_checkpointing section with mode full, on the wrapped "
    "blocks (an alias; the section also takes selective, every and ops)",
    "forward_prefetch": "all-gather the next block's parameters during the current block's forward",
    "sync_module_states": "broadcast rank 0's parameters and buffers before sharding (default: false for fsdp, "
    "true for model_parallel)",
    "cpu_ram_efficient_loading": "a model the Trainer builds (model_init) is built on rank 0 only, the other ranks on "
    "the meta device, and rank 0's values are scattered into the shards (implies sync_module_states)",
    "tp_plan": "with a tp axis: auto (the Transformers model's plan) or {module-name pattern: colwise | rowwise | "
    "colwise_gather_output | embedding_rowwise | replicate}",
    "sequence_parallel": "with a tp axis: the activations between the tp_plan's TP regions are split by sequence (norms "
    "run on 1/tp of the tokens; reduce-scatter + all-gather instead of all-reduce); derived from "
    "the plan, refused where kiln cannot derive it; default false",
    "loss_parallel": "with a tp axis: the head's logits stay split by vocabulary and the model's cross entropy runs on "
    "the split (HF ForCausalLMLoss; else the head stays gathered, with a log line); default false",
}

_FLAGS = (
    "offload",
    "activation_checkpointing",
    "forward_prefetch",
    "sync_module_states",
    "cpu_ram_efficient_loading",
    "offload_pin_memory",
    "reshard_after_forward",
)
_STRICT = ("sequence_parallel", "loss_parallel")  # kiln's own keys only: no text forms to read


@dataclass
class MeshSettings:
    wrap: list[str] | None = None
    min_num_params: int | None = None
    offload: bool = False
    #: None: pin when the device is an accelerator
    offload_pin_memory: bool | None = None
    reshard_after_forward: bool | None = None
    state_dict_type: str = "sharded"
    activation_checkpointing: bool = False
    forward_prefetch: bool = False
    sync_module_states: bool = False
    cpu_ram_efficient_loading: bool = False
    tp_plan: Any = None
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def reshard(self) -> bool:
        """Whether FSDP frees a unit's gathered parameters after its forward (ZeRO-3) or keeps them (ZeRO-2)."""
        return True if self.reshard_after_forward is None else bool(self.reshard_after_forward)


def set_shared(s: MeshSettings, key: str, value: Any) -> bool:
    """Set the shared setting `key` from a config value (text forms of yes/no included); False when
    `key` is no shared setting."""
    if key == "wrap":
        s.wrap = class_names(value) or None
    elif key == "min_num_params":
        s.min_num_params = int(value) or None
    elif key in _FLAGS:
        setattr(s, key, truthy(value))
    elif key in _STRICT:
        if not isinstance(value, bool):
            raise ConfigError(f"strategy.{key} is {value!r}; give true or false.")
        setattr(s, key, value)
    elif key == "state_dict_type":
        kind = STATE_DICT_TYPES.get(str(value).lower())
        if kind is None:
            raise ConfigError(f"state_dict_type {value!r} is not sharded or full; fix strategy.state_dict_type.")
        s.state_dict_type = kind
    elif key == "tp_plan":
        s.tp_plan = value
    else:
        return False
    return True


def read_shared(option: Callable[[str], Any], s: MeshSettings) -> MeshSettings:
    """`s` with every shared option the config sets (`option(name)` is None when unset)."""
    for key in SHARED:
        value = option(key)
        if value is not None:
            set_shared(s, key, value)
    check_shared(s)
    return s


def check_shared(s: MeshSettings) -> None:
    if s.wrap and s.min_num_params:
        raise ConfigError(
            "FSDP wrap (transformer_layer_cls_to_wrap) and min_num_params are both set; set only one of them."
        )
