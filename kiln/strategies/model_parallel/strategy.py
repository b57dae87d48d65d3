"""`strategy: model_parallel`: the mesh strategy (kiln/strategies/mesh/strategy.py) with its mesh
written out -- FSDP2 over the data-parallel axes (dp_replicate, dp_shard, with cp flattened into
dp_shard), tensor parallelism over `tp`, context parallelism over `cp`:

    strategy: {name: model_parallel, mesh: {dp_shard: 2, tp: 2}, tp_plan: auto}
    strategy: {name: model_parallel, mesh: {tp: 2}, sequence_parallel: true, loss_parallel: true}

Missing axes are 1, one may be -1 (the rest of the processes); the default is `{dp_shard: -1}`, FSDP
over every process. HF's `parallelism_config` selects it with the same mesh. Every other setting is
the mesh strategy's and means what it means under `strategy: fsdp`; the one default that differs is
`sync_module_states` (true here: every rank starts from rank 0's weights, whatever seed built them)."""

from __future__ import annotations

from kiln.strategies import STRATEGIES
from kiln.strategies.mesh.dims import AXES
from kiln.strategies.mesh.settings import SHARED, MeshSettings, read_shared
from kiln.strategies.mesh.strategy import MeshStrategy


@STRATEGIES.register("model_parallel")
class ModelParallelStrategy(MeshStrategy):
    name = "model_parallel"
    options = {
        "mesh": f"axis sizes {{{', '.join(AXES)}}}; missing axes are 1, one may be -1 (the rest); default "
        "{dp_shard: -1}; pp and ep are reserved (refused)",
        **SHARED,
        "cp_load_balance": "with cp: cut each sequence in 2 x cp pieces, rank r keeping pieces r and 2cp-1-r "
        "(torch's head-tail order, balancing causal attention's work; the default, true), or false: "
        "piece r of cp",
    }

    def read_settings(self) -> MeshSettings:
        return read_shared(self.option, MeshSettings(sync_module_states=True))

    def mesh_request(self, world_size: int) -> dict[str, int] | None:
        mesh = self.option("mesh")
        return None if mesh is None else dict(mesh)
