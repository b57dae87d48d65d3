"""`trainer.save_model(dir)`: the final weights as safetensors plus the config, loadable without
kiln (`safetensors.torch.load_file`) and, for Transformers models, with `from_pretrained`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kiln.engine.checkpoint.hf_files import write_training_args
from kiln.strategies.model_weights import save_weights

if TYPE_CHECKING:
    from torch import nn

    from kiln.strategies.base import Strategy


def export_model(
    model: nn.Module,
    strategy: Strategy,
    config: Any,
    processing_class: Any,
    output_dir: str,
    max_shard_size: int | str | None = None,
    training_args: Any = None,
) -> str:
    """Write `model`'s full weights (gathered by the strategy if sharded) into `output_dir`; every
    rank calls this, the node's writer writes. `training_args` (the user's TrainingArguments, else
    built from `config`) is written as `training_args.bin`, as HF's `save_model` does."""
    state = strategy.model_state_for_export(model)  # the user's module, gathered if sharded
    writer = strategy.is_global_zero or (config.save.on_each_node and strategy.is_local_zero)
    if writer:
        os.makedirs(output_dir, exist_ok=True)
        save_pretrained = getattr(model, "save_pretrained", None)
        if save_pretrained is not None:  # Transformers: config.json + weights, from_pretrained works
            shard = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
            with _deepspeed_unloaded_stays_unloaded():
                save_pretrained(output_dir, state_dict=state, safe_serialization=config.save.safetensors, **shard)
        else:
            save_weights(state, output_dir, config.save.safetensors, max_shard_size=max_shard_size)
            with open(os.path.join(output_dir, "kiln_model.json"), "w") as fh:
                json.dump({"class": f"{type(model).__module__}.{type(model).__qualname__}"}, fh, indent=2)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(output_dir)
        from omegaconf import OmegaConf

        from kiln.config.redact import config_for_saving

        OmegaConf.save(config_for_saving(config), os.path.join(output_dir, "kiln_config.yaml"))
        write_training_args(output_dir, config, training_args)
    strategy.barrier("save-model")
    return output_dir


@contextlib.contextmanager
def _deepspeed_unloaded_stays_unloaded() -> Iterator[None]:
    """`save_pretrained` asks accelerate whether the model is a DeepSpeed engine, which imports deepspeed
    (seconds, and its "Setting accelerator" warning) when it is installed. Without deepspeed imported no
    model can be one, so accelerate is told it is unavailable for the call."""
    try:
        if "deepspeed" in sys.modules:
            raise ImportError
        import accelerate.utils.other as other  # transformers' save_pretrained imports it anyway
    except ImportError:
        yield
        return
    real = getattr(other, "is_deepspeed_available", None)
    if real is None:
        yield
        return
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = real
