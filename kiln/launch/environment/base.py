"""The value every caller receives (`ClusterEnvironment`: this process's place in the job) and the
shape of a cluster kind (`ClusterKind`: a launcher or scheduler that recognises its own variables
and reads the topology from them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

Env = Mapping[str, str]


@dataclass(frozen=True)
class ClusterEnvironment:
    """This process's place in the job. `main_address`/`main_port` are set only for launchers that
    do not export MASTER_ADDR/MASTER_PORT themselves (SLURM); otherwise torch reads `env://`."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    source: str = (
        "none"  # the `name` of the ClusterKind that read it: ray | torchrun | accelerate | deepspeed | slurm | none
    )
    main_address: str | None = None
    main_port: int | None = None
    rendezvous: bool = False  # whether the launcher gave an address for the process group to meet at
    #: how many times this job was started before: torchrun's elastic restarts plus SLURM requeues
    restart_count: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def launched(self) -> bool:
        """Whether a launcher (rather than a plain `python`) started this process."""
        return self.source != "none"

    @property
    def init_method(self) -> str:
        """The `init_method` for `torch.distributed.init_process_group`."""
        if self.main_address:
            return f"tcp://{self.main_address}:{self.main_port}"
        return "env://"


class ClusterKind:
    """One launcher or scheduler. Subclasses say whether the environment is theirs (`detects`) and
    read the topology from it (`read`); `kiln.launch.environment.KINDS` asks them in order."""

    name: ClassVar[str]

    @classmethod
    def detects(cls, env: Env) -> bool:
        raise NotImplementedError

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        raise NotImplementedError


def current(env: Env | None) -> Env:
    """`env`, or this process's environment when None."""
    return os.environ if env is None else env


def visible_devices(env: Env | None = None) -> str | None:
    """`CUDA_VISIBLE_DEVICES` as the user set it (None when unset), for error messages."""
    return current(env).get("CUDA_VISIBLE_DEVICES")


def restart_count(env: Env) -> int:
    """How many times the job was started before this attempt, by any launcher: torchrun's elastic
    agent counts its restarts of the worker group (TORCHELASTIC_RESTART_COUNT), SLURM its requeues
    of the job (SLURM_RESTART_COUNT); torchrun inside a requeued SLURM job has both."""
    total = 0
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = env.get(name, "")
        total += int(value) if value.isdigit() else 0
    return total
