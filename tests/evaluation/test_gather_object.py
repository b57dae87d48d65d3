"""`eval_use_gather_object`: predictions that are not tensors (here decoded strings from
preprocess_logits_for_metrics) are gathered once with all_gather_object; on a simulated 3-rank world
every rank gets the single-process answer in dataset order, the sampler's padding duplicates dropped."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from kiln import Trainer, load_config
from tests.evaluation.common import config, digits, make_model
from tests.evaluation.test_simulated_world import SimulatedRank, World


class ObjectWorld(World):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.objects: list[Any] = [None] * size
        self.calls = 0
        self.lock = threading.Lock()

    def all_gather_object(self, rank: int, obj: Any) -> list[Any]:
        with self.lock:
            self.calls += 1
        self.objects[rank] = obj
        self.barrier.wait()
        out = list(self.objects)
        self.barrier.wait()
        return out


class ObjectRank(SimulatedRank):
    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.world.all_gather_object(self.global_rank, obj)


def decode(logits: torch.Tensor, labels: Any) -> list[str]:
    return [f"class-{int(i)}" for i in logits.argmax(-1)]


def text_accuracy(pred: Any) -> dict[str, float]:
    assert isinstance(pred.predictions, list) and all(isinstance(p, str) for p in pred.predictions)
    return {
        "accuracy": float(np.mean([p == f"class-{int(y)}" for p, y in zip(pred.predictions, pred.label_ids)])),
        "n": float(len(pred.predictions)),
    }


def test_string_predictions_are_gathered_in_dataset_order(tmp_path: Any) -> None:
    _, evals = digits(n_eval=16)
    single = Trainer(
        make_model("module"),
        config(tmp_path / "single", per_device_eval_batch_size=2, eval_use_gather_object=True),
        preprocess_logits_for_metrics=decode,
        compute_metrics=text_accuracy,
    ).evaluate(evals)  # one process
    expected = Trainer(make_model("module"), config(tmp_path / "ref", per_device_eval_batch_size=2)).predict(evals)
    expected_text = [f"class-{int(i)}" for i in expected.predictions.argmax(-1)]

    world = ObjectWorld(3)  # 16 samples, batch 2, 3 ranks: rank 2 repeats samples 0 and 1
    ranks = []
    for rank in range(3):
        cfg = config(tmp_path / str(rank), per_device_eval_batch_size=2, eval_use_gather_object=True)
        ranks.append(
            Trainer(
                make_model("module"),
                cfg,
                strategy=ObjectRank(load_config(cfg), None, world, rank),
                preprocess_logits_for_metrics=decode,
                compute_metrics=text_accuracy,
            )
        )
    results = world.run(lambda r: ranks[r].predict(evals))
    assert world.calls == 3  # once per rank, at the end, not per step
    for out in results:
        assert out.predictions == expected_text
        np.testing.assert_array_equal(out.label_ids, evals.labels.numpy())
        assert out.metrics["test_n"] == 16.0
        assert out.metrics["test_accuracy"] == single["eval_accuracy"]
        assert out.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)
