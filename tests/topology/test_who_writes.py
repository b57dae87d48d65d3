"""Which rank writes or locks which file, on a 2-node x 2-process job faked in one process
(tests/topology/fake_world.py). Checkpoints need every rank at once (the writer makes the folder the
others write their own files into), so they run on a ThreadWorld with every write recorded by the
thread, i.e. the rank, that made it. The files a rank writes alone (`save_model`, `save_state`,
`save_metrics`, `kiln predict`'s results) are checked with per-rank output folders: a file that appears
in rank r's folder was written by rank r."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch

from kiln import Trainer
from kiln.engine.callbacks.state import TrainerState
from kiln.engine.checkpoint import output_dir as output_dir_module
from kiln.engine.checkpoint.manager import CheckpointManager
from kiln.strategies import full_checkpoint_io
from tests.helpers import TinyRegressor, regression_data
from tests.topology.fake_world import ThreadWorld, stand_in

RANKS = [0, 1, 2, 3]
#: what only the checkpoint's writer writes (training_args.bin too, where transformers is in use)
SHARED = {"model.safetensors", "optimizer.pt", "scheduler.pt", "precision.pt", "trainer_state.json", "COMPLETE"}


def _config(out, **overrides):
    cfg = {
        "output_dir": str(out),
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "report_to": "none",
        "strategy": {"device": "cpu"},
        "save": {"strategy": "steps", "steps": 2},
        "log": {"history": [], "disable_tqdm": True, "steps": 10},
    }
    cfg.update(overrides)
    return cfg


def _record(monkeypatch, world: ThreadWorld) -> dict[int, list[str]]:
    """rank -> the names of the files it wrote (torch.save, the weights, trainer_state.json, the COMPLETE
    marker) and "LOCK" for each time it took output_dir's run lock."""
    seen: dict[int, list[str]] = defaultdict(list)

    def noting(real, name_of):
        def call(*args, **kwargs):
            seen[world.current_rank].append(name_of(*args, **kwargs))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(
        torch, "save", noting(torch.save, lambda obj, f, *a, **k: os.path.basename(getattr(f, "name", f)))
    )
    monkeypatch.setattr(
        full_checkpoint_io, "save_weights", noting(full_checkpoint_io.save_weights, lambda *a, **k: "model.safetensors")
    )
    monkeypatch.setattr(
        TrainerState, "save_to_json", noting(TrainerState.save_to_json, lambda self, path: os.path.basename(path))
    )
    monkeypatch.setattr(CheckpointManager, "_publish", noting(CheckpointManager._publish, lambda *a, **k: "COMPLETE"))
    monkeypatch.setattr(output_dir_module, "acquire", noting(output_dir_module.acquire, lambda out: "LOCK"))
    return seen


def _fit_world(monkeypatch, out_of_rank, **overrides) -> dict[int, list[str]]:
    world = ThreadWorld(nodes=2, per_node=2)
    seen = _record(monkeypatch, world)
    models = [TinyRegressor() for _ in RANKS]  # built here: model construction draws from the shared RNG

    def fit(rank: int) -> None:
        Trainer(
            models[rank],
            _config(out_of_rank(rank), **overrides),
            train_dataset=regression_data(32),
            strategy=world.strategy(rank),
        ).fit()

    world.run(fit)
    return seen


def _per_checkpoint(names: list[str]) -> set[str]:
    return set(names) - {"training_args.bin"}


def test_on_a_shared_folder_rank_0_writes_the_checkpoint_and_every_rank_its_own_state(tmp_path, monkeypatch):
    seen = _fit_world(monkeypatch, lambda rank: tmp_path)
    for rank in RANKS:
        own = {f"rng_state_{rank}.pth", f"loop_state_{rank}.pt"}
        if rank == 0:
            assert _per_checkpoint(seen[0]) == SHARED | own | {"LOCK"}  # the one run lock of the folder
        else:
            assert _per_checkpoint(seen[rank]) == own  # named by the global rank: 2 and 3 never overwrite 0 and 1
        assert seen[rank].count(f"rng_state_{rank}.pth") == 2  # checkpoint-2 and the final checkpoint-3
    for step in (2, 3):
        files = set(os.listdir(tmp_path / f"checkpoint-{step}"))
        assert {f"rng_state_{r}.pth" for r in RANKS} | {f"loop_state_{r}.pt" for r in RANKS} | SHARED <= files
    assert not (tmp_path / output_dir_module.LOCK).exists()  # released at the end


def test_with_save_on_each_node_each_nodes_local_rank_0_writes_its_nodes_checkpoint(tmp_path, monkeypatch):
    """Node-local disks: each node has its own output_dir (the ranks of one node share it)."""
    seen = _fit_world(
        monkeypatch,
        lambda rank: tmp_path / f"node{rank // 2}",
        save={"strategy": "steps", "steps": 2, "on_each_node": True},
    )
    for rank in RANKS:
        own = {f"rng_state_{rank}.pth", f"loop_state_{rank}.pt"}
        assert _per_checkpoint(seen[rank]) == (SHARED | own | {"LOCK"} if rank % 2 == 0 else own)
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        files = set(os.listdir(tmp_path / f"node{node}" / "checkpoint-3"))
        assert {f for f in files if f.startswith("rng_state_")} == {f"rng_state_{r}.pth" for r in ranks}
        assert SHARED <= files


@pytest.mark.parametrize("on_each_node", [False, True])
@pytest.mark.parametrize("rank", RANKS)
def test_save_model_is_written_by_the_writer_and_save_state_and_metrics_by_global_rank_0(tmp_path, rank, on_each_node):
    """save_model follows the checkpoint writer (HF's `should_save`); trainer_state.json and the results
    files are global rank 0's even with save_on_each_node (HF's save_state / save_metrics)."""
    out = tmp_path / f"rank{rank}"
    trainer = Trainer(
        TinyRegressor(), _config(out, save={"strategy": "no", "on_each_node": on_each_node}), strategy=stand_in(rank)
    )
    trainer.save_model()
    trainer.save_state()
    trainer.save_metrics("train", {"train_loss": 0.5})
    files = set(os.listdir(out)) if out.is_dir() else set()
    writer = rank == 0 or (on_each_node and rank % 2 == 0)
    for name in ("model.safetensors", "kiln_model.json", "kiln_config.yaml"):
        assert (name in files) == writer, name
    for name in ("trainer_state.json", "train_results.json", "all_results.json"):
        assert (name in files) == (rank == 0), name


@pytest.mark.parametrize("rank", RANKS)
def test_log_metrics_prints_on_global_rank_0(tmp_path, capsys, rank):
    Trainer(TinyRegressor(), _config(tmp_path), strategy=stand_in(rank)).log_metrics("train", {"train_loss": 0.5})
    assert ("***** train metrics *****" in capsys.readouterr().out) == (rank == 0)


def test_kiln_predict_results_are_written_by_global_rank_0(tmp_path):
    """Every rank predicts (and gets every row); only global rank 0 writes predictions.npy and the results."""
    from kiln.cli import _score

    world = ThreadWorld(nodes=2, per_node=2)
    models = [TinyRegressor() for _ in RANKS]
    data = regression_data(12)

    def predict(rank: int) -> None:
        trainer = Trainer(models[rank], _config(tmp_path / f"rank{rank}"), strategy=world.strategy(rank))
        _score("predict", trainer, {"test_dataset": data}, None)

    world.run(predict)
    for rank in RANKS:
        folder = tmp_path / f"rank{rank}" / "random-weights"
        assert folder.is_dir() == (rank == 0)
    import numpy as np

    assert np.load(tmp_path / "rank0" / "random-weights" / "predictions.npy").shape == (12,)
    results = json.loads((tmp_path / "rank0" / "random-weights" / "predict_results.json").read_text())
    assert results["weights"] is None and "test_loss" in results
