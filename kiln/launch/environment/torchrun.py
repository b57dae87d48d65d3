"""torchrun, and kiln's own `kiln fit --nproc` (torch's elastic agent, in-process): the launcher
exports RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK and MASTER_ADDR / MASTER_PORT,
so the process group meets at `env://` (a restarted attempt: see `attempt_store`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.launch.environment.base import ClusterEnvironment, ClusterKind, Env, current

if TYPE_CHECKING:
    from datetime import timedelta


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


def attempt_store(timeout: timedelta, env: Env | None = None, creation: int = 0) -> Any:
    """The store a restarted attempt of an elastic job meets in, or None where torch's `env://` is right.

    torch's elastic agent keeps one store for the workers (MASTER_ADDR / MASTER_PORT, hosted by the
    agent: TORCHELASTIC_USE_AGENT_STORE) across the restarts of `--max-restarts`, and `env://` no
    longer gives each attempt a prefix of its own. The keys the last attempt left (gloo's peer
    addresses, barrier counters) are then read by the new one, which connects to ports of processes
    that are gone ("Connection refused") or passes a barrier early. So from the first restart on, each
    attempt meets under `kiln/attempt_<n>/` of that store. Every worker of one agent sees the same n;
    several nodes' agents count their restarts each on its own, which is why restarts across nodes
    need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt, hosted by rank 0).

    The same holds within one attempt: a default group made again after one was destroyed (two
    Trainers with `teardown()` between them in one job) would read the first group's addresses, so
    the process's `creation`-th group (counted from 0, the same count on every rank of a symmetric
    program) meets under `kiln/attempt_<n>/group_<creation>/`."""
    env = current(env)
    _warn_shared_store_across_nodes(env)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not attempt.isdigit():
        return None
    if int(attempt) == 0 and creation == 0:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), False, timeout)
    prefix = f"kiln/attempt_{attempt}" + (f"/group_{creation}" if creation else "")
    return dist.PrefixStore(prefix, store)  # keys: kiln/attempt_<n>[/group_<c>]/<key>


def _warn_shared_store_across_nodes(env: Env) -> None:
    """Rank 0's warning, before anything fails, for restarts across nodes on the agents' shared store."""
    restarts, world, local = (
        env.get("TORCHELASTIC_MAX_RESTARTS", "0"),
        env.get("WORLD_SIZE", "1"),
        env.get("LOCAL_WORLD_SIZE"),
    )
    if (
        env.get("RANK") != "0"
        or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or not restarts.isdigit()
        or int(restarts) == 0
        or not local
        or int(world) <= int(local)
    ):
        return
    import logging

    logging.getLogger("kiln").warning(
        "This job spans several nodes with --max-restarts %s on the store torchrun's agents share: each node's "
        "agent counts its restarts on its own, so a restarted attempt can meet keys another attempt left and hang; "
        "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node (docs/launching.md).",
        restarts,
    )
