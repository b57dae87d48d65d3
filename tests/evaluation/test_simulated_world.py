"""The real evaluation loop (Trainer.predict / evaluate) on a simulated world: one Trainer per rank,
each on its own thread, with a strategy whose all_gather stacks the ranks' tensors. Every rank must
get the single-process answer: dataset order, the sampler's duplicates dropped. (The gathering
rules themselves are tested in tests/engine/test_gather.py; a real DDP run is tested elsewhere.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from kiln import EvalPrediction, Trainer, load_config
from kiln.strategies.single import SingleDeviceStrategy
from tests.evaluation.common import accuracy, config, digits, make_model


class World:
    """`size` ranks on threads; `all_gather` stacks every rank's tensor (Strategy.all_gather)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * size

    def all_gather(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        out = torch.stack(self.slots)  # type: ignore[arg-type]
        self.barrier.wait()
        return out

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        with ThreadPoolExecutor(self.size) as pool:
            return [f.result() for f in [pool.submit(fn, rank) for rank in range(self.size)]]


class SimulatedRank(SingleDeviceStrategy):
    def __init__(self, config: Any, precision: Any, world: World, rank: int) -> None:
        super().__init__(config, precision)
        self.world, self.world_size, self.global_rank = world, world.size, rank

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.world.all_gather(self.global_rank, tensor)


def trainers(tmp_path: Any, world: World, compute_metrics: Any = accuracy, **overrides: Any) -> list[Trainer]:
    out = []
    for rank in range(world.size):
        cfg = config(tmp_path / str(rank), per_device_eval_batch_size=2, **overrides)
        strategy = SimulatedRank(load_config(cfg), None, world, rank)
        out.append(Trainer(make_model("module"), cfg, strategy=strategy, compute_metrics=compute_metrics))
    return out


@pytest.mark.parametrize("overrides", [{}, {"eval_accumulation_steps": 2}, {"eval_do_concat_batches": False}])
def test_predict_matches_one_process(tmp_path: Any, overrides: dict[str, Any]) -> None:
    """HF's worked example: 16 samples, batch 2, 3 processes (rank 2 repeats samples 0 and 1)."""
    _, evals = digits(n_eval=16)
    single = Trainer(
        make_model("module"), config(tmp_path / "single", per_device_eval_batch_size=2), compute_metrics=accuracy
    ).predict(evals)
    world = World(3)
    ranks = trainers(tmp_path, world, **overrides)
    assert [len(t.get_test_dataloader(evals)) for t in ranks] == [3, 3, 3]  # each rank sees its shard only
    results = world.run(lambda r: ranks[r].predict(evals))
    for out in results:
        predictions, labels = out.predictions, out.label_ids
        if isinstance(predictions, list):  # one entry per batch, rank 0's first: still dataset order
            predictions, labels = np.concatenate(predictions), np.concatenate(labels)
        np.testing.assert_allclose(predictions, single.predictions, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(labels, evals.labels.numpy())
        assert out.metrics["test_accuracy"] == single.metrics["test_accuracy"]
        assert out.metrics["test_loss"] == pytest.approx(single.metrics["test_loss"], rel=1e-6)
        assert out.metrics["test_samples_per_second"] == pytest.approx(
            16 / out.metrics["test_runtime"], rel=0.05, abs=1
        )


def test_batch_eval_metrics_sees_each_sample_once(tmp_path: Any) -> None:
    _, evals = digits(n_eval=16)
    world = World(3)
    seen: dict[int, list[int]] = {}

    def counting(rank: int) -> Callable[..., dict[str, float]]:
        def metrics(p: EvalPrediction, compute_result: bool) -> dict[str, float]:
            seen.setdefault(rank, []).extend(p.label_ids.tolist())
            return {"rows": float(len(seen[rank]))} if compute_result else {}

        return metrics

    ranks = trainers(tmp_path, world, batch_eval_metrics=True)
    for rank, trainer in enumerate(ranks):
        trainer.compute_metrics = counting(rank)
        trainer.eval_dataset = evals
    results = world.run(lambda r: ranks[r].evaluate())
    for rank, metrics in enumerate(results):
        assert metrics["eval_rows"] == 16  # the two duplicates of rank 2 are not counted
        assert sorted(seen[rank]) == sorted(evals.labels.tolist())

    seen.clear()  # predict() still returns every prediction, in dataset order
    for out in world.run(lambda r: ranks[r].predict(evals)):
        np.testing.assert_array_equal(out.label_ids, evals.labels.numpy())
        assert out.predictions.shape == (16, 10) and out.metrics["test_rows"] == 16


def test_drop_last_keeps_whole_global_batches(tmp_path: Any) -> None:
    _, evals = digits(n_eval=16)
    world = World(3)
    ranks = trainers(tmp_path, world, dataloader_drop_last=True)
    for out in world.run(lambda r: ranks[r].predict(evals)):
        np.testing.assert_array_equal(out.label_ids, evals.labels[:12].numpy())  # 16 // (2 * 3) * 6 rows


def test_sampler_drop_last_layout() -> None:
    from kiln.engine.data.samplers import SequentialDistributedSampler
    from kiln.engine.evaluation.gather import OrderedGatherer

    shards = [list(SequentialDistributedSampler(16, 3, r, batch_size=2, drop_last=True)) for r in range(3)]
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # whole global batches, nothing repeated
    sampler = SequentialDistributedSampler(16, 3, 0, batch_size=2, drop_last=True)
    gatherer = OrderedGatherer.for_sampler(sampler)
    assert (sampler.num_examples, gatherer.num_samples, gatherer.process_length) == (12, 12, 4)
    assert SequentialDistributedSampler(16, 3, 0).num_examples == 16
    assert len(SequentialDistributedSampler(5, 3, 0, batch_size=2, drop_last=True)) == 0
    with pytest.raises(ValueError, match="batch_size"):
        SequentialDistributedSampler(16, 3, 0, drop_last=True)


def test_a_loader_without_kiln_sampler_is_not_gathered_and_says_so(tmp_path: Any, caplog: Any) -> None:
    """A DataLoader passed as given has no SequentialDistributedSampler: nothing is gathered (each rank reports
    what its loader yielded, here all 6 rows) and a warning says so."""
    _, evals = digits(n_eval=6)
    loader = torch.utils.data.DataLoader(evals, batch_size=2)
    world = World(2)
    ranks = trainers(tmp_path, world)
    with caplog.at_level("WARNING", logger="kiln.engine.loop.evaluation"):
        results = world.run(lambda r: ranks[r].predict(loader))
    assert [len(out.predictions) for out in results] == [6, 6]
    warned = [r for r in caplog.records if "without kiln's eval sampler on 2 ranks" in r.getMessage()]
    assert len(warned) == 2  # once per rank
    caplog.clear()
    with caplog.at_level("WARNING", logger="kiln.engine.loop.evaluation"):
        Trainer(make_model("module"), config(tmp_path / "single")).predict(loader)
    assert not caplog.records  # one process: nothing to gather, nothing to say
