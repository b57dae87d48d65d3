"""`strategy: model_parallel`: the mesh strategy (kiln/strategies/mesh/strategy.py) with its mesh
written out -- FSDP2 over the data-parallel axes (dp_replicate, dp_shard, with cp flattened into
dp_shard), tensor parallelism over `tp`, context parallelism over `cp`, pipeline stages over `pp`
(mesh/pipeline.py; alone or beside one of dp_shard, dp_replicate or tp), and the experts of MoE layers
over `ep` (mesh/expert_parallel.py; alone, within dp_shard, beside tp or beside dp_replicate):

    strategy: {name: model_parallel, mesh: {dp_shard: 2, tp: 2}, tp_plan: auto}
    strategy: {name: model_parallel, mesh: {tp: 2}, sequence_parallel: true, loss_parallel: true}
    strategy: {name: model_parallel, mesh: {pp: 2, tp: 2}}
    strategy: {name: model_parallel, mesh: {ep: 2}}
    strategy: {name: model_parallel, mesh: {dp_shard: 4, ep: 2}}
    strategy: {name: model_parallel, mesh: {ep: 2, tp: 2}}
    strategy: {name: model_parallel, mesh: {dp_replicate: 2, ep: 2}}

Missing axes are 1, one may be -1 (the rest of the processes); the default is `{dp_shard: -1}`, FSDP
over every process. HF's `parallelism_config` selects it with the same mesh. Every other setting is
the mesh strategy's and means what it means under `strategy: fsdp`; the one default that differs is
`sync_module_states` (true here: every rank starts from rank 0's weights, whatever seed built them)."""

from __future__ import annotations

from typing import Any

from kiln.strategies import STRATEGIES
from kiln.strategies.mesh.dims import AXES, EP, PP
from kiln.strategies.mesh.expert_parallel import ExpertParallelStrategy
from kiln.strategies.mesh.pipeline import PipelineStrategy
from kiln.strategies.mesh.settings import SHARED, MeshSettings, read_shared
from kiln.strategies.mesh.strategy import MeshStrategy
from kiln.utils.errors import ConfigError


@STRATEGIES.register("model_parallel")
class ModelParallelStrategy(MeshStrategy):
    name = "model_parallel"
    options = {
        "mesh": f"axis sizes {{{', '.join((PP, *AXES, EP))}}}; missing axes are 1, one may be -1 (the rest); default "
        "{dp_shard: -1}; pp (pipeline stages) runs alone or with one of dp_shard (each stage FSDP-sharded over it), dp_replicate "
        "(each stage replicated over it) or tp (each stage tensor-parallel over it), ep (experts of MoE layers split over it) alone, "
        "within dp_shard (its ranks borrowed from dp_shard, which FSDP shards the rest over), beside tp (the rest "
        "tensor-parallel) or beside dp_replicate (replicas of ep's ranks)",
        "pipeline": "with a pp axis: {schedule: gpipe | 1f1b (default) | interleaved_1f1b | interleaved_zb | zbv, "
        "stages_per_rank: 1 (2 or more for the interleaved ones, 2 for zbv; default 2 for them), microbatches: the "
        "accumulation window's (gradient_accumulation_steps), split: auto (default) | [first layer of each stage "
        "after the first], or the model's configure_pipeline(mesh)}",
        **SHARED,
        "cp_load_balance": "with cp: cut each sequence in 2 x cp pieces, rank r keeping pieces r and 2cp-1-r "
        "(torch's head-tail order, balancing causal attention's work; the default, true), or false: "
        "piece r of cp",
    }

    @classmethod
    def resolve(cls, config: Any) -> type[MeshStrategy]:
        """The pipeline's class when the mesh has a pp axis (it owns the accumulation window), the
        expert-parallel one when it has an ep axis (parse_mesh refuses both at once)."""
        options = config.strategy.get("options") or {}
        mesh = options.get("mesh") or {}
        pp = mesh.get(PP, 1)
        if pp == 1 and options.get("pipeline") is not None:
            raise ConfigError(
                "strategy.pipeline is set, but strategy.mesh has no pp axis; set mesh.pp to the number of "
                "stages, or drop pipeline."
            )
        if pp != 1:
            return ModelParallelPipeline
        return cls if mesh.get(EP, 1) == 1 else ModelParallelExperts

    def read_settings(self) -> MeshSettings:
        return read_shared(self.option, MeshSettings(sync_module_states=True))

    def mesh_request(self, world_size: int) -> dict[str, int] | None:
        mesh = self.option("mesh")
        return None if mesh is None else dict(mesh)


class ModelParallelPipeline(ModelParallelStrategy, PipelineStrategy):
    """`model_parallel` with a pp axis (kiln/strategies/mesh/pipeline.py); chosen by `resolve`."""


class ModelParallelExperts(ModelParallelStrategy, ExpertParallelStrategy):
    """`model_parallel` with an ep axis (kiln/strategies/mesh/expert_parallel.py); chosen by `resolve`."""
