"""The pipeline's DCP checkpoints: the mesh strategy's (checkpoint_io.py), whose model and optimizer
tensors each stage already writes under the full model's names (pipeline_split.py), with one thing
mended -- the optimizer's param groups, which DCP writes once (from one rank) though each stage's list
only its own parameters. Each stage writes the groups of the whole model (every stage's names, in
stage order), so a pipeline checkpoint is one model's, resumable on one process or any other mesh;
loaded under a pipeline, each stage keeps the names it holds."""

from __future__ import annotations

from typing import Any

from kiln.strategies.mesh.checkpoint_io import ShardedCheckpointIO
from kiln.utils.errors import CheckpointError


class PipelineCheckpointIO(ShardedCheckpointIO):
    translatable = False  # a stage holds part of the model: it resumes pipeline and DCP checkpoints only

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        mine = [list(group["params"]) for group in state["param_groups"]]
        stages: list[Any] = [None] * self.strategy.shape.pp
        dist.all_gather_object(stages, mine, group=self.strategy.pp_group)
        if len({len(names) for names in stages}) > 1:
            raise CheckpointError(
                f"the pipeline's stages hold {', '.join(str(len(n)) for n in stages)} optimizer param groups, "
                "which one checkpoint cannot describe; give every stage the same groups (weight_decay 0 puts "
                "every parameter in one)."
            )
        groups = [
            {**group, "params": [name for names in stages for name in names[g]]}
            for g, group in enumerate(state["param_groups"])
        ]
        return {**state, "param_groups": groups}

    def loaded_optimizer_state(self, saved: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
        held = {name for group in groups for name in group["params"]}
        kept = [{**group, "params": [n for n in group["params"] if n in held]} for group in saved["param_groups"]]
        return {**saved, "param_groups": kept}
