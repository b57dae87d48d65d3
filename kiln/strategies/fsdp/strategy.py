"""`strategy: fsdp`: Fully Sharded Data Parallel on PyTorch's FSDP2 (`fully_shard`, DTensor
parameters), as a preset of the mesh strategy (kiln/strategies/mesh/strategy.py). Each rank keeps
1/N of the parameters, gradients and optimizer state; a block's parameters are all-gathered just
before it runs and freed after, gradients are reduce-scattered.

The preset writes the mesh from HF's sharding names:

    full_shard          {dp_shard: N}                                  reshard after forward (ZeRO-3)
    shard_grad_op       {dp_shard: N}                                  keep gathered after forward (ZeRO-2)
    no_shard            {dp_replicate: N}                              replicate only, DDP's maths
    hybrid_shard        {dp_replicate: N / shard_size, dp_shard: shard_size}   shard inside a node, replicate across
    hybrid_shard_zero2  the same, ZeRO-2

and with `tp: T` the mesh gains a tp axis of size T, the sharding taking the N / T data-parallel ranks
left (`full_shard` + `tp: 2` is `{dp_shard: N / 2, tp: 2}`). Everything else is the mesh strategy's,
exactly as under `strategy: model_parallel`. Settings come from kiln's own keys, HF's `fsdp` /
`fsdp_config` or accelerate's FSDP config; see options.py.

The loss weights are DDP's: FSDP2 divides the reduced gradients by the data-parallel size, like DDP."""

from __future__ import annotations

import logging

from kiln.strategies import STRATEGIES
from kiln.strategies.fsdp.options import NATIVE, FSDPSettings, resolve
from kiln.strategies.mesh.strategy import MeshStrategy
from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)


@STRATEGIES.register("fsdp", "fsdp2")
class FSDPStrategy(MeshStrategy):
    name = "fsdp"
    options = dict(NATIVE)
    settings: FSDPSettings

    def read_settings(self) -> FSDPSettings:
        settings = resolve(self.option)
        for key, why in settings.no_effect.items():
            log.warning("FSDP setting %r has no effect: %s.", key, why)
        return settings

    def mesh_request(self, world_size: int) -> dict[str, int] | None:
        """The sharding option's mesh on `world_size` processes (see the module docstring)."""
        s = self.settings
        if s.tp < 1 or world_size % s.tp:
            raise ConfigError(
                f"strategy.tp is {s.tp}, which does not divide the world size ({world_size}); set tp to a "
                f"divisor of {world_size}."
            )
        dp = world_size // s.tp
        tp = {"tp": s.tp} if s.tp > 1 else {}
        if s.sharding in ("full_shard", "shard_grad_op"):
            return {"dp_shard": dp, **tp}
        if s.sharding == "no_shard":
            return {"dp_replicate": dp, **tp}
        per_node = self.cluster.local_world_size // s.tp if self.cluster.local_world_size else 0
        shard = s.shard_size or per_node or dp
        if shard < 1 or dp % shard:
            size = "world size" if s.tp == 1 else "data-parallel size (world size / tp)"
            raise ConfigError(
                f"{s.sharding} needs the {size} ({dp}) to be a multiple of the shard group size ({shard}); "
                f"set strategy.shard_size to a divisor of {dp}."
            )
        return {"dp_replicate": dp // shard, "dp_shard": shard, **tp}
