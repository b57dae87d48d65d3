"""Each process's CUDA device on the second node of a two-node job is `cuda:<local rank>`.

One node with as many GPUs as processes cannot tell local and global ranks apart (they are equal
there), so the single-node tests pass whichever pick_device uses; on node 1 of 2 the global rank
(2 or 3) names a GPU that does not exist. No GPU is needed: CUDA availability and the device count
are mocked, the topology comes from the variables torchrun / SLURM set on that node."""

from __future__ import annotations

import pytest
import torch

from kiln.launch.environment import detect
from kiln.strategies.process_group import pick_device

#: global rank 3 of 4 = local rank 1 on node 1, as torchrun --nnodes=2 --nproc_per_node=2 sets it
TORCHRUN_NODE1 = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
#: the same process started by `srun --nodes=2 --ntasks-per-node=2`
SLURM_NODE1 = {
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "n[1-2]",
}


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("env", [TORCHRUN_NODE1, SLURM_NODE1], ids=["torchrun", "slurm"])
@pytest.mark.parametrize("gpus", [2, 4], ids=["2gpus", "4gpus"])
def test_second_node_rank_uses_its_local_rank_as_the_device_index(monkeypatch, env, gpus):
    """With 2 GPUs per node cuda:3 does not exist; with 4 it exists but is the wrong one (two
    processes of the job would never share it, and node 1's GPUs 2 and 3 would idle)."""
    _gpus(monkeypatch, gpus)
    cluster = detect(env)
    assert (cluster.rank, cluster.local_rank, cluster.node_rank, cluster.num_nodes) == (3, 1, 1, 2)
    assert pick_device(cluster, None) == torch.device("cuda", 1)
    assert pick_device(cluster, "cuda") == torch.device("cuda", 1)


def test_the_ddp_strategy_on_the_second_node_picks_the_local_device(monkeypatch):
    """The same through the strategy's constructor, which reads os.environ (no group is created)."""
    from kiln.config.load import load_config
    from kiln.precision.fp32 import FP32Precision
    from kiln.strategies.ddp.strategy import DDPStrategy

    _gpus(monkeypatch, 2)
    for key in ("SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in TORCHRUN_NODE1.items():
        monkeypatch.setenv(key, value)
    strategy = DDPStrategy(load_config({"strategy": {"name": "ddp"}}), FP32Precision())
    assert (strategy.global_rank, strategy.local_rank, strategy.world_size) == (3, 1, 4)
    assert strategy.root_device == torch.device("cuda", 1)
