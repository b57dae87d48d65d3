"""`accelerate launch`: it runs torchrun (or, for DeepSpeed on several machines, the deepspeed
launcher) underneath, or the script directly for one process, and adds its ACCELERATE_* settings.
The topology is the underlying launcher's; `source` says accelerate, because its settings apply."""

from __future__ import annotations

from dataclasses import replace

from kiln.launch.environment.base import ClusterEnvironment, ClusterKind, Env
from kiln.launch.environment.deepspeed import DeepSpeedLauncher
from kiln.launch.environment.slurm import Slurm
from kiln.launch.environment.torchrun import Torchrun

_MARKERS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU")


def launched_by_accelerate(env: Env) -> bool:
    return any(k in env for k in _MARKERS)


class Accelerate(ClusterKind):
    name = "accelerate"

    @classmethod
    def detects(cls, env: Env) -> bool:
        # one accelerate process inside a multi-task srun step: SLURM's topology is the truth
        return launched_by_accelerate(env) and (Torchrun.detects(env) or not Slurm.detects(env))

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        for under in (DeepSpeedLauncher, Torchrun):
            if under.detects(env):
                return replace(under.read(env), source=cls.name)
        return ClusterEnvironment(source=cls.name)  # `accelerate launch --num_processes 1`: the script itself
