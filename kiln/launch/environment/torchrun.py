"""torchrun, and kiln's own `kiln fit --nproc` (torch's elastic agent, in-process): the launcher
exports RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK and MASTER_ADDR / MASTER_PORT,
so the process group meets at `env://`."""

from __future__ import annotations

from kiln.launch.environment.base import ClusterEnvironment, ClusterKind, Env


class Torchrun(ClusterKind):
    name = "torchrun"

    @classmethod
    def detects(cls, env: Env) -> bool:
        return "WORLD_SIZE" in env and "RANK" in env

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node = env.get("GROUP_RANK", env.get("NODE_RANK"))
        return ClusterEnvironment(
            world_size=world,
            rank=rank,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=local_world,
            node_rank=int(node) if node is not None else rank // max(local_world, 1),
            num_nodes=max(-(-world // max(local_world, 1)), 1),
            source=cls.name,
            rendezvous="MASTER_ADDR" in env and "MASTER_PORT" in env,
        )
