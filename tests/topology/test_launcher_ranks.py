"""Global, local and node rank as each launcher hands them over, on a process of the *second or third*
node: there the three differ from each other and from what a wrong formula gives (on one node, and at
rank 0 of any node, `rank % per_node`, `rank // per_node`, the local rank and the global rank coincide
often enough to hide a swap). Environment stand-ins for torchrun, the deepspeed launcher, accelerate,
SLURM and Ray; torch's fake process group where a group must already exist."""

from __future__ import annotations

import pytest

from kiln.launch.environment import detect
from kiln.launch.environment import ray as ray_env

#: global rank 5 of a 3-node x 2-process job: local rank 1 on node 2 (5 % 2 == 1, 5 // 2 == 2)
TORCHRUN = {
    "WORLD_SIZE": "6",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
DEEPSPEED = {
    "WORLD_SIZE": "6",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "LOCAL_SIZE": "2",
    "CROSS_RANK": "2",
    "CROSS_SIZE": "3",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_NTASKS": "6",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NNODES": "3",
    "SLURM_NTASKS_PER_NODE": "2(x3)",
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_JOB_ID": "42",
}
ACCELERATE = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True"}


class RayContext:
    """What Ray Train's context says on the same process."""

    def get_world_size(self):
        return 6

    def get_world_rank(self):
        return 5

    def get_local_rank(self):
        return 1

    def get_local_world_size(self):
        return 2

    def get_node_rank(self):
        return 2


@pytest.mark.parametrize(
    "env, source",
    [
        (TORCHRUN, "torchrun"),
        (DEEPSPEED, "deepspeed"),
        ({**TORCHRUN, **ACCELERATE}, "accelerate"),
        ({**DEEPSPEED, **ACCELERATE}, "accelerate"),
        (SLURM, "slurm"),
        ({**SLURM, **TORCHRUN}, "torchrun"),  # torchrun inside an sbatch allocation
        ("ray", "ray"),
    ],
    ids=["torchrun", "deepspeed", "accelerate-torchrun", "accelerate-deepspeed", "slurm", "torchrun-in-slurm", "ray"],
)
def test_each_launcher_gives_global_local_and_node_rank_of_a_third_node_process(monkeypatch, env, source):
    if env == "ray":
        monkeypatch.setattr(ray_env, "train_context", lambda: RayContext())
        env = {"WORLD_SIZE": "6", "RANK": "5"}  # Ray exports torchrun's names too; its context is the truth
    reading = detect(env)
    assert reading.source == source
    assert (reading.world_size, reading.rank, reading.local_rank, reading.local_world_size) == (6, 5, 1, 2)
    assert (reading.node_rank, reading.num_nodes) == (2, 3)


@pytest.mark.parametrize("rank, local_world, node", [(2, 2, 1), (3, 2, 1), (5, 2, 2), (4, 4, 1), (7, 4, 1), (3, 1, 3)])
def test_torchrun_without_a_group_rank_derives_the_node_from_rank_over_local_world(rank, local_world, node):
    """GROUP_RANK is torchrun's; a process started another way that exports torchrun's rank variables
    may lack it: the node is then `RANK // LOCAL_WORLD_SIZE` (RANK=2, LOCAL_WORLD_SIZE=2 is node 1;
    `%` would give its local rank, 0)."""
    env = {
        "WORLD_SIZE": "8",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local_world),
        "LOCAL_WORLD_SIZE": str(local_world),
    }
    reading = detect(env)
    assert (reading.rank, reading.local_rank, reading.node_rank, reading.num_nodes) == (
        rank,
        rank % local_world,
        node,
        8 // local_world,
    )


def test_torchrun_takes_node_rank_when_group_rank_is_missing():
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "3"}
    assert detect(env).node_rank == 3  # as set, even where rank // per_node says otherwise
    assert detect({**env, "GROUP_RANK": "1"}).node_rank == 1  # torchrun's own name wins


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"WORLD_SIZE": "4"}, {"LOCAL_RANK": "1", "GROUP_RANK": "1"}])
def test_a_lone_rank_variable_is_no_torchrun_job(env):
    """torchrun sets RANK and WORLD_SIZE together; one of them alone (left over in a shell, or set by another
    tool) is not a job to join."""
    reading = detect(env)
    assert (reading.source, reading.world_size, reading.rank, reading.node_rank) == ("none", 1, 0, 0)


def test_without_local_world_size_every_process_is_on_one_node():
    reading = detect({"WORLD_SIZE": "3", "RANK": "2"})
    assert (reading.local_rank, reading.local_world_size, reading.node_rank, reading.num_nodes) == (0, 3, 0, 1)


# -- the strategy takes the launcher's ranks --------------------------------------------------------------
NODE1 = {
    "WORLD_SIZE": "4",
    "RANK": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
}


@pytest.fixture
def node1(monkeypatch):
    """This process as global rank 2 = local rank 0 of node 1 in a 2 x 2 torchrun job."""
    for key in ("SLURM_NTASKS", "SLURM_PROCID", "NODE_RANK", *ACCELERATE):
        monkeypatch.delenv(key, raising=False)
    for key, value in NODE1.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def fake_group():
    """torch's fake process group (no peers, every collective returns at once), torn down afterwards."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _ddp():
    from kiln.config.load import load_config
    from kiln.precision.fp32 import FP32Precision
    from kiln.strategies.ddp.strategy import DDPStrategy

    return DDPStrategy(load_config({"strategy": {"name": "ddp", "device": "cpu"}}), FP32Precision())


def test_the_ddp_strategy_takes_every_rank_from_the_launcher(node1):
    strategy = _ddp()
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank) == (4, 2, 0, 1)
    assert not strategy.is_global_zero and strategy.is_local_zero
    assert (strategy.data_shards, strategy.data_shard_rank) == (4, 2)  # the data shard is the global rank's


def test_in_a_group_that_already_exists_the_group_gives_world_and_rank_the_launcher_the_rest(node1, fake_group):
    fake_group(3, 6)  # made by the user (or TrainingArguments) before kiln: it decides world size and rank
    strategy = _ddp()
    strategy.setup_environment()
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank) == (6, 3, 0, 1)
    strategy.teardown()  # a group kiln did not make is left to its maker
    import torch.distributed as dist

    assert dist.is_initialized()


@pytest.mark.parametrize(
    "rank, local_rank, local, goes_first",
    [
        (2, 0, True, True),  # node 1's local rank 0: first on its node
        (2, 0, False, False),  # ... but not the job's main process
        (3, 1, True, False),
        (0, 0, False, True),
    ],
)
def test_main_process_first_before_a_trainer_reads_the_launcher(
    monkeypatch, node1, fake_group, rank, local_rank, local, goes_first
):
    from kiln.engine.distributed import main_process_first
    from kiln.strategies import process_group

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("GROUP_RANK", str(rank // 2))
    fake_group(rank, 4)  # the group it joins exists already (the DDP strategy then reuses it)
    calls: list[str] = []
    monkeypatch.setattr(process_group, "barrier", lambda device, backend: calls.append("barrier"))
    with main_process_first(local=local, desc="tokenize"):
        calls.append("work")
    assert calls == (["work", "barrier"] if goes_first else ["barrier", "work"])
