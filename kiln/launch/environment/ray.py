"""Ray Train: a worker of a `TorchTrainer` (kiln's `kiln fit --ray N`, or your own TorchTrainer).

Ray Train exports torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and also
ACCELERATE_TORCH_DEVICE, so this kind is asked before accelerate and torchrun; the topology is read
from Ray's own train context, which is the truth those variables copy. Ray has created the default
process group before the training function runs (gloo on CPU, NCCL on GPUs): the strategies find it
and use it (`kiln.strategies.process_group.init_process_group` creates none when one exists)."""

from __future__ import annotations

import sys
from typing import Any

from kiln.launch.environment.base import ClusterEnvironment, ClusterKind, Env


def train_context() -> Any | None:
    """Ray Train's context in this process, or None outside a Ray Train worker (a plain process, Ray's
    driver, a Ray Tune trial). Never imports Ray: a process Ray Train started has imported it already."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        return train.get_context()
    except Exception:  # noqa: BLE001 - RuntimeError outside a worker, DeprecationWarning in a Tune trial
        return None


class RayTrain(ClusterKind):
    name = "ray"

    @classmethod
    def detects(cls, env: Env) -> bool:
        # the variables Ray exports, in a process that really is a Ray Train worker (not a fake mapping)
        return "WORLD_SIZE" in env and "RANK" in env and train_context() is not None

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        context = train_context()
        assert context is not None  # detects() said so
        world, local_world = context.get_world_size(), context.get_local_world_size()
        return ClusterEnvironment(
            world_size=world,
            rank=context.get_world_rank(),
            local_rank=context.get_local_rank(),
            local_world_size=local_world,
            node_rank=context.get_node_rank(),
            num_nodes=max(-(-world // max(local_world, 1)), 1),
            source=cls.name,
            rendezvous="MASTER_ADDR" in env and "MASTER_PORT" in env,
        )
