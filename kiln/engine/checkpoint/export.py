"""`trainer.save_model(dir)`: the final weights as safetensors plus the config, loadable without
kiln (`safetensors.torch.load_file`) and, for Transformers models, with `from_pretrained`."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional, Union

from kiln.strategies.checkpoint_io import save_weights

if TYPE_CHECKING:
    from kiln.engine.protocols import TrainerLike


def export_model(trainer: "TrainerLike", output_dir: str, max_shard_size: Optional[Union[int, str]] = None) -> str:
    strategy = trainer.strategy
    state = strategy.model_state_for_export(trainer.model)  # the user's module, gathered if sharded
    writer = strategy.is_global_zero or (trainer.config.save.on_each_node and strategy.is_local_zero)
    if writer:
        os.makedirs(output_dir, exist_ok=True)
        model = trainer.model
        if hasattr(model, "save_pretrained"):  # Transformers: config.json + weights, from_pretrained works
            shard = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
            model.save_pretrained(output_dir, state_dict=state, safe_serialization=trainer.config.save.safetensors, **shard)
        else:
            save_weights(state, output_dir, trainer.config.save.safetensors, max_shard_size=max_shard_size)
            with open(os.path.join(output_dir, "kiln_model.json"), "w") as fh:
                json.dump({"class": f"{type(model).__module__}.{type(model).__qualname__}"}, fh, indent=2)
        if trainer.processing_class is not None and hasattr(trainer.processing_class, "save_pretrained"):
            trainer.processing_class.save_pretrained(output_dir)
        from omegaconf import OmegaConf

        from kiln.config.redact import config_for_saving
        OmegaConf.save(config_for_saving(trainer.config), os.path.join(output_dir, "kiln_config.yaml"))
    strategy.barrier("save-model")
    return output_dir
