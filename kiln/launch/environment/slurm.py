"""SLURM's `srun` with more than one task: the topology comes from SLURM_* variables, and the
rendezvous (which srun does not export) is the job's first host and a port derived from the job id,
as Lightning's SLURMEnvironment does, unless MASTER_ADDR / MASTER_PORT are set."""

from __future__ import annotations

import re

from kiln.launch.environment.base import ClusterEnvironment, ClusterKind, Env


class Slurm(ClusterKind):
    name = "slurm"

    @classmethod
    def detects(cls, env: Env) -> bool:
        # a single task (or an `salloc` shell without srun) is not a distributed job
        return int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        match = re.match(r"^(\d+)", env.get("SLURM_NTASKS_PER_NODE", ""))
        local_world = int(match.group(1)) if match else max(world // max(nodes, 1), 1)
        nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
        return ClusterEnvironment(
            world_size=world,
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=local_world,
            node_rank=int(env.get("SLURM_NODEID", 0)),
            num_nodes=nodes,
            source=cls.name,
            main_address=env.get("MASTER_ADDR") or first_host(nodelist) or "127.0.0.1",
            main_port=int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))),
            rendezvous=True,
        )


def first_host(nodelist: str) -> str | None:
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
