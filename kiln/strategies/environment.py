"""What the launcher told this process: the only place kiln reads launcher environment variables
(torchrun / `accelerate launch` / `kiln fit --nproc`, SLURM's srun)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterEnvironment:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    source: str = "none"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect() -> ClusterEnvironment:
    """Read the process topology from the environment a launcher set up."""
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:  # torchrun, accelerate launch, deepspeed, kiln --nproc
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        rank = int(env["RANK"])
        source = "accelerate" if "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_USE_FSDP" in env else "torchrun"
        return ClusterEnvironment(
            world_size=world,
            rank=rank,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=local_world,
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", rank // max(local_world, 1)))),
            source=source,
        )
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", "1"))
        return ClusterEnvironment(
            world_size=world,
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=max(world // max(nodes, 1), 1),
            node_rank=int(env.get("SLURM_NODEID", 0)),
            source="slurm",
        )
    return ClusterEnvironment()
