"""Where this process sits in the job, as the launcher told it: torchrun (and `kiln fit --nproc`,
which runs torch's elastic launcher), `accelerate launch`, the `deepspeed` launcher, SLURM's srun,
and `CUDA_VISIBLE_DEVICES`. Topology only: what a launcher asks of the run's *settings* (mixed
precision, FSDP/DeepSpeed, compile) and how that meets the kiln config is `launcher_settings.py`.
Everything else receives the result as a `ClusterEnvironment`, never as environment reads.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

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
    source: str = "none"  # torchrun | accelerate | slurm | none
    main_address: Optional[str] = None
    main_port: Optional[int] = None
    rendezvous: bool = False  # whether the launcher gave an address for the process group to meet at

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


def _env(env: Optional[Env]) -> Env:
    return os.environ if env is None else env


def launched_by_accelerate(env: Optional[Env] = None) -> bool:
    env = _env(env)
    return any(k in env for k in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU"))


def detect(env: Optional[Env] = None) -> ClusterEnvironment:
    """Read the process topology from the environment a launcher set up (`env` defaults to
    `os.environ`). torchrun-style variables win over SLURM's, so `torchrun` inside an `sbatch`
    allocation is read correctly."""
    env = _env(env)
    accelerate = launched_by_accelerate(env)
    if "WORLD_SIZE" in env and "RANK" in env:  # torchrun, kiln --nproc, accelerate launch, deepspeed
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node = env.get("GROUP_RANK", env.get("NODE_RANK"))
        return ClusterEnvironment(
            world_size=world,
            rank=rank,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=local_world,
            node_rank=int(node) if node is not None else rank // max(local_world, 1),
            num_nodes=max(-(-world // max(local_world, 1)), 1),
            source="accelerate" if accelerate else "torchrun",
            rendezvous="MASTER_ADDR" in env and "MASTER_PORT" in env,
        )
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:  # srun
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        per_node = env.get("SLURM_NTASKS_PER_NODE", "")
        match = re.match(r"^(\d+)", per_node)
        local_world = int(match.group(1)) if match else max(world // max(nodes, 1), 1)
        nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
        job_id = env.get("SLURM_JOB_ID", "0")
        return ClusterEnvironment(
            world_size=world,
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=local_world,
            node_rank=int(env.get("SLURM_NODEID", 0)),
            num_nodes=nodes,
            source="slurm",
            main_address=env.get("MASTER_ADDR") or first_host(nodelist) or "127.0.0.1",
            main_port=int(env.get("MASTER_PORT") or slurm_port(job_id)),
            rendezvous=True,
        )
    return ClusterEnvironment(source="accelerate" if accelerate else "none")


def first_host(nodelist: str) -> Optional[str]:
    """The first host of a SLURM nodelist: `gpu[003-005,009],cpu01` -> `gpu003`."""
    if not nodelist:
        return None
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end]
    if "[" not in entry:
        return entry
    prefix, rest = entry.split("[", 1)
    ranges, _, suffix = rest.partition("]")
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def slurm_port(job_id: str) -> int:
    """A port every task of one SLURM job computes alike (Lightning's rule: 15000 + last 4 digits)."""
    digits = re.sub(r"\D", "", job_id)[-4:] or "0"
    return 15000 + int(digits)


def visible_devices(env: Optional[Env] = None) -> Optional[str]:
    """`CUDA_VISIBLE_DEVICES` as the user set it (None when unset), for error messages."""
    return _env(env).get("CUDA_VISIBLE_DEVICES")
