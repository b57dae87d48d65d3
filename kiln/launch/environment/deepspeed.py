"""The `deepspeed` launcher (deepspeed.launcher.launch): torchrun's RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, but the node's process count and the node's index under its own names
(LOCAL_SIZE, CROSS_RANK, CROSS_SIZE) instead of LOCAL_WORLD_SIZE / GROUP_RANK."""

from __future__ import annotations

from dataclasses import replace

from kiln.launch.environment.base import ClusterEnvironment, Env
from kiln.launch.environment.torchrun import Torchrun


class DeepSpeedLauncher(Torchrun):
    name = "deepspeed"

    @classmethod
    def detects(cls, env: Env) -> bool:
        return super().detects(env) and "CROSS_RANK" in env and "LOCAL_SIZE" in env

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        base = super().read({**env, "LOCAL_WORLD_SIZE": env["LOCAL_SIZE"], "GROUP_RANK": env["CROSS_RANK"]})
        return replace(base, num_nodes=int(env.get("CROSS_SIZE") or base.num_nodes))
