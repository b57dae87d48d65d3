"""Which rank reads what, on a 2-node x 2-process job faked in one process (tests/topology/fake_world.py):
a resumed rank's RNG streams and loop sums come from the files of its *global* rank; on a shared folder
global rank 0 alone chooses (and checks) the checkpoint to resume and the others take its answer, while
with save_on_each_node each node reads its own copy; every rank must name one output_dir (one per node
with save_on_each_node); and each rank trains on the data shard of its global rank."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kiln import Trainer
from kiln.config import load_config
from kiln.engine.checkpoint import resume as resume_module
from kiln.engine.checkpoint.files import _fsync_tree
from kiln.engine.checkpoint.integrity import ALGORITHM
from kiln.engine.checkpoint.resume import ResumeError, choose_resume
from kiln.engine.distributed import check_same_output_dir
from kiln.utils.errors import ConfigError
from tests.checkpoint.checkpoint_helpers import Crash, numeric_history, train, weights
from tests.topology.fake_world import ThreadWorld, stand_in

RANKS = [0, 1, 2, 3]


def test_a_resumed_rank_reads_the_rng_and_loop_state_of_its_global_rank(tmp_path):
    """Global rank 2 (node 1's local rank 0, writing its node's copy with save_on_each_node) resumes bitwise
    although the folder also holds rank 0's files, as a folder every node shares would: reading by
    local rank would take rank 0's RNG streams (other dropout masks) and loss sums (another train_loss)."""
    cfg = {"max_steps": 8, "save_steps": 4, "save_on_each_node": True}
    straight = train(str(tmp_path / "straight"), cfg, strategy=stand_in(2))
    out = str(tmp_path / "killed")
    with pytest.raises(Crash):
        train(out, cfg, crash_at=4, strategy=stand_in(2))
    with pytest.raises(Crash):  # rank 0's files of another run: other random streams, other sums
        train(str(tmp_path / "rank0"), {**cfg, "seed": 99}, crash_at=4, strategy=stand_in(0))
    for name in ("rng_state_0.pth", "loop_state_0.pt"):
        shutil.copy(tmp_path / "rank0" / "checkpoint-4" / name, tmp_path / "killed" / "checkpoint-4" / name)
    _reseal(tmp_path / "killed" / "checkpoint-4")  # a folder every node shares lists every rank's files
    resumed = train(out, cfg, model_seed=1234, resume=True, strategy=stand_in(2))
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert numeric_history(resumed) == numeric_history(straight)  # train_loss from rank 2's own sums


def _reseal(folder) -> None:
    """Rewrite `folder`'s COMPLETE marker for the files it holds now, as the writer would have."""
    marker = folder / "COMPLETE"
    meta = json.loads(marker.read_text())
    marker.unlink()
    meta["files"], meta[ALGORITHM] = _fsync_tree(str(folder))
    marker.write_text(json.dumps(meta))


def _strategies(world: ThreadWorld, out_of_rank, on_each_node: bool) -> list:
    return [
        world.strategy(rank)(
            load_config(
                {
                    "output_dir": str(out_of_rank(rank)),
                    "save": {"on_each_node": on_each_node},
                    "strategy": {"device": "cpu"},
                }
            ),
            None,
        )
        for rank in RANKS
    ]


@pytest.fixture
def checkpoints(tmp_path):
    """Two complete checkpoints in `tmp_path/node0` (a short single-process run)."""
    train(str(tmp_path / "node0"), {"max_steps": 4, "save_steps": 2, "save_total_limit": None})
    return tmp_path


def _resolvers(monkeypatch, world: ThreadWorld) -> list:
    calls: list = []
    real = resume_module.resolve_resume
    monkeypatch.setattr(
        resume_module, "resolve_resume", lambda *a, **k: (calls.append(world.current_rank), real(*a, **k))[1]
    )
    return calls


def test_on_a_shared_folder_global_rank_0_alone_chooses_the_checkpoint(checkpoints, monkeypatch):
    world = ThreadWorld()
    calls = _resolvers(monkeypatch, world)
    strategies = _strategies(world, lambda rank: checkpoints / "node0", on_each_node=False)
    chosen = world.run(lambda rank: choose_resume(True, strategies[rank].config, strategies[rank]))
    assert calls == [0]  # one reader of every file's checksums
    assert chosen == [str(checkpoints / "node0" / "checkpoint-4")] * 4
    with pytest.raises(
        ResumeError, match="Can.t find a valid checkpoint at .*missing"
    ):  # its refusal reaches every rank
        world.run(lambda rank: choose_resume(str(checkpoints / "missing"), strategies[rank].config, strategies[rank]))


def test_with_save_on_each_node_every_rank_reads_its_nodes_copy(checkpoints, monkeypatch):
    shutil.copytree(checkpoints / "node0" / "checkpoint-2", checkpoints / "node1" / "checkpoint-2")  # node 1 is behind
    world = ThreadWorld()
    calls = _resolvers(monkeypatch, world)
    strategies = _strategies(world, lambda rank: checkpoints / f"node{rank // 2}", on_each_node=True)
    chosen = world.run(lambda rank: choose_resume(True, strategies[rank].config, strategies[rank]))
    assert sorted(calls) == RANKS
    assert (
        chosen == [str(checkpoints / "node0" / "checkpoint-4")] * 2 + [str(checkpoints / "node1" / "checkpoint-2")] * 2
    )


@pytest.mark.parametrize(
    "on_each_node, folders, refused",
    [
        (False, ["a", "a", "a", "a"], False),
        (False, ["a", "a", "b", "b"], True),  # one folder for the whole job
        (True, ["a", "a", "b", "b"], False),  # one per node
        (True, ["a", "a", "b", "c"], True),  # ... shared by the ranks of that node
    ],
)
def test_every_rank_names_the_same_output_dir_or_one_per_node(tmp_path, on_each_node, folders, refused):
    world = ThreadWorld()
    strategies = _strategies(world, lambda rank: tmp_path / folders[rank], on_each_node)
    run = lambda: world.run(lambda rank: check_same_output_dir(strategies[rank].config, strategies[rank]))  # noqa: E731
    if refused:
        with pytest.raises(ConfigError, match="output_dir differs between"):
            run()
    else:
        run()


def test_each_rank_trains_on_the_shard_of_its_global_rank(tmp_path):
    data = [{"x": torch.full((8,), float(i)), "y": torch.tensor(0.0)} for i in range(16)]
    shards = []
    for rank in RANKS:
        trainer = Trainer(
            torch.nn.Linear(8, 1),
            {
                "output_dir": str(tmp_path),
                "per_device_train_batch_size": 2,
                "strategy": {"device": "cpu"},
                "report_to": "none",
            },
            train_dataset=data,
            strategy=stand_in(rank),
        )
        shards.append({int(x[0]) for batch in trainer.get_train_dataloader() for x in batch["x"]})
    assert all(len(shard) == 4 for shard in shards)
    assert set().union(*shards) == set(range(16))  # disjoint quarters: ranks 2 and 3 do not repeat ranks 0 and 1
