"""Evaluation gathering without a process group: a world of ranks is simulated either by
concatenating each rank's batch by hand (what all_gather returns) or by threads that share a fake
all_gather, so the exact collective sequence of the eval loop runs on one CPU."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from kiln.engine.evaluation.accumulator import EvalAccumulator
from kiln.engine.evaluation.gather import (
    OrderedGatherer,
    SequentialDistributedSampler,
    gather_across_processes,
    pad_across_processes,
    restore_order,
)
from kiln.engine.evaluation.nested import (
    concat_padded,
    nested_concat,
    nested_concat_all,
    nested_detach,
    nested_numpify,
    nested_to_cpu,
    nested_truncate,
    pad_and_concat,
)
from kiln.engine.evaluation.outputs import EvalLoopOutput, EvalPrediction, PredictionOutput


# -- a simulated world --------------------------------------------------------------------------
class FakeWorld:
    """`world_size` threads with an all_gather that stacks every rank's tensor (Strategy.all_gather)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=20)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.calls = 0

    def all_gather(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            shapes = {tuple(s.shape) for s in self.slots}  # type: ignore[union-attr]
            assert len(shapes) == 1, f"all_gather needs equal shapes, got {shapes}"
            out = torch.stack(self.slots)  # type: ignore[arg-type]
            if rank == 0:
                self.calls += 1
            self.barrier.wait()
            return out

        return gather

    def run(self, fn: Callable[[int, Callable[[torch.Tensor], torch.Tensor]], Any]) -> list[Any]:
        with ThreadPoolExecutor(self.world_size) as pool:
            futures = [pool.submit(fn, rank, self.all_gather(rank)) for rank in range(self.world_size)]
            return [f.result() for f in futures]


def shards(n: int, world: int, sampler_batch: int | None = None) -> list[list[int]]:
    return [list(SequentialDistributedSampler(n, world, r, sampler_batch)) for r in range(world)]


def batches(indices: list[int], batch_size: int) -> list[list[int]]:
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def gather_by_hand(
    n: int, world: int, batch_size: int, sampler_batch: int | None = None, every: int = 1
) -> list[np.ndarray]:
    """What all_gather returns when the loop gathers every `every` steps: rank-major index chunks."""
    per_rank = [batches(s, batch_size) for s in shards(n, world, sampler_batch)]
    steps = len(per_rank[0])
    assert all(len(b) == steps for b in per_rank), "every rank must run the same number of steps"
    chunks = []
    for start in range(0, steps, every):
        rank_chunks = [sum(per_rank[r][start : start + every], []) for r in range(world)]
        chunks.append(np.array(sum(rank_chunks, []), dtype=np.int64))
    return chunks


# -- HF's DistributedTensorGatherer worked example (reference 5.4, E21) ------------------------
def test_hf_worked_example_16_samples_3_processes_batch_2() -> None:
    assert shards(16, 3) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 1]]
    chunks = gather_by_hand(16, 3, 2)
    assert chunks[0].tolist() == [0, 1, 6, 7, 12, 13]
    assert np.concatenate(chunks).tolist() == [0, 1, 6, 7, 12, 13, 2, 3, 8, 9, 14, 15, 4, 5, 10, 11, 0, 1]

    gatherer = OrderedGatherer(world_size=3, num_samples=16)
    for chunk in chunks:
        gatherer.add_arrays(chunk)
    assert gatherer.finalize().tolist() == list(range(16))


@pytest.mark.parametrize(
    "n, world, batch_size, sampler_batch, every",
    [
        (16, 3, 2, None, 1),
        (16, 3, 2, 2, 2),  # gather every 2 steps (eval_accumulation_steps=2)
        (7, 2, 3, None, 1),  # last step has 1 row per rank
        (7, 2, 3, 3, 1),  # shard padded to a multiple of the batch size
        (5, 4, 1, None, 1),
        (5, 4, 3, 3, 1),  # needs 7 duplicates from 5 samples: HF's sampler asserts here
        (5, 4, 2, None, 3),
        (1, 4, 2, None, 1),
        (12, 3, 4, None, 1),  # no padding at all
    ],
)
def test_ordered_gatherer_restores_dataset_order(
    n: int, world: int, batch_size: int, sampler_batch: int | None, every: int
) -> None:
    sampler = SequentialDistributedSampler(n, world, 0, sampler_batch)
    gatherer = OrderedGatherer.for_sampler(sampler)
    assert gatherer.process_length == len(sampler) and gatherer.total_samples == sampler.total_size
    for chunk in gather_by_hand(n, world, batch_size, sampler_batch, every):
        gatherer.add_arrays(chunk)
    assert gatherer.finalize().tolist() == list(range(n))


def test_ordered_gatherer_multi_dim_nested_and_growing_sequences() -> None:
    n, world, bs = 7, 2, 3

    def outputs(idx: list[int], seq: int) -> dict[str, Any]:
        ids = np.array(idx, dtype=np.float32)
        logits = np.broadcast_to(ids[:, None, None], (len(idx), seq, 4)).copy()
        return {"predictions": (logits, ids * 10), "label_ids": np.tile(np.array(idx)[:, None], (1, seq))}

    gatherer = OrderedGatherer(world, n, padding_index=-7)
    per_rank = [batches(s, bs) for s in shards(n, world)]
    seq_of_step = [2, 5]  # the second step has longer sequences: storage grows
    for step, seq in enumerate(seq_of_step):
        parts = [outputs(per_rank[r][step], seq) for r in range(world)]
        gatherer.add_arrays(nested_concat_all(parts))
    result = gatherer.finalize()
    logits, scaled = result["predictions"]
    labels = result["label_ids"]
    assert logits.shape == (7, 5, 4) and labels.shape == (7, 5) and scaled.tolist() == [i * 10 for i in range(7)]
    step_of_sample: dict[int, int] = {}
    for r in range(world):  # first occurrence: later ones are the sampler's padding duplicates
        for s, b in enumerate(per_rank[r]):
            for i in b:
                step_of_sample.setdefault(i, s)
    for i in range(n):
        seq = seq_of_step[step_of_sample[i]]
        assert (logits[i, :seq] == i).all() and (logits[i, seq:] == -7).all()
        assert (labels[i, :seq] == i).all() and (labels[i, seq:] == -7).all()


def test_ordered_gatherer_errors_and_incomplete_warning(caplog: pytest.LogCaptureFixture) -> None:
    gatherer = OrderedGatherer(2, 4)
    assert gatherer.finalize() is None
    with pytest.raises(ValueError, match="evenly"):
        gatherer.add_arrays(np.arange(3))
    gatherer.add_arrays(np.array([0, 2]))
    with caplog.at_level("WARNING"):
        assert gatherer.finalize().tolist() == [0, -100, 2, -100]
    assert "1 of 2 rows" in caplog.text
    gatherer.add_arrays(np.array([1, 3]))
    with pytest.raises(ValueError, match="disagree"):
        gatherer.add_arrays(np.array([9, 9]))


def test_drop_duplicates_for_batch_eval_metrics() -> None:
    gatherer = OrderedGatherer(3, 16)
    last = torch.tensor([4, 5, 10, 11, 0, 1])  # the worked example's last gathered step
    assert gatherer.drop_duplicates(last, rows_before=4).tolist() == [4, 5, 10, 11]
    first = np.array([0, 1, 6, 7, 12, 13])
    assert gatherer.drop_duplicates({"p": first}, rows_before=0)["p"] is first
    seen = [gatherer.drop_duplicates(c, rows_before=2 * s) for s, c in enumerate(gather_by_hand(16, 3, 2))]
    assert sorted(np.concatenate(seen).tolist()) == list(range(16))


# -- the sampler --------------------------------------------------------------------------------
def test_sequential_distributed_sampler_layout() -> None:
    assert shards(5, 4, 3) == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    for n, world, bs in [(16, 3, None), (7, 2, 3), (0, 2, None), (100, 8, 5)]:
        parts = shards(n, world, bs)
        assert len({len(p) for p in parts}) == 1
        flat = sum(parts, [])
        assert flat[:n] == list(range(n)), "contiguous shards in rank order are the dataset in order"
        assert len(SequentialDistributedSampler(n, world, 0, bs)) == len(parts[0])
    with pytest.raises(ValueError, match="rank"):
        SequentialDistributedSampler(4, 2, 2)


# -- padding and concatenation ------------------------------------------------------------------
def test_pad_and_concat_pads_right_with_minus_100() -> None:
    a = torch.tensor([[1, 2], [3, 4]])
    b = torch.tensor([[5, 6, 7]])
    out = pad_and_concat(a, b)
    assert out.tolist() == [[1, 2, -100], [3, 4, -100], [5, 6, 7]]
    assert pad_and_concat(b, a, padding_index=0).tolist() == [[5, 6, 7], [1, 2, 0], [3, 4, 0]]
    npo = pad_and_concat(a.numpy(), b.numpy(), padding_index=-1)
    assert isinstance(npo, np.ndarray) and npo.tolist() == [[1, 2, -1], [3, 4, -1], [5, 6, 7]]
    assert pad_and_concat(torch.arange(2), torch.arange(3)).tolist() == [0, 1, 0, 1, 2]


def test_pad_and_concat_3d_dtypes_scalars_and_type_errors() -> None:
    a, b = torch.ones(1, 2, 3), torch.zeros(2, 4, 1, dtype=torch.float64)
    out = pad_and_concat(a, b)
    assert out.shape == (3, 4, 3) and out.dtype == torch.float64
    assert (out[0, :2, :3] == 1).all() and (out[0, 2:] == -100).all() and (out[1:, :, 1:] == -100).all()
    assert pad_and_concat(torch.tensor(1.5), torch.tensor(2.5)).tolist() == [1.5, 2.5]
    assert pad_and_concat(np.ones((1, 2), np.float32), np.ones((1, 2), np.int64)).dtype == np.float64
    with pytest.raises(TypeError, match="nested_numpify"):
        pad_and_concat(torch.ones(1), np.ones(1))
    with pytest.raises(ValueError, match="ranks"):
        pad_and_concat(torch.ones(1, 2), torch.ones(1))


def test_nested_concat_structures() -> None:
    a = {"logits": (torch.ones(1, 2), torch.zeros(1)), "labels": [np.array([[1]])], "none": None}
    b = {"logits": (torch.ones(2, 3), torch.zeros(2)), "labels": [np.array([[2, 3]])], "none": None}
    out = nested_concat(a, b, padding_index=-1)
    assert isinstance(out["logits"], tuple) and isinstance(out["labels"], list) and out["none"] is None
    assert out["logits"][0].tolist() == [[1, 1, -1], [1, 1, 1], [1, 1, 1]]
    assert out["labels"][0].tolist() == [[1, -1], [2, 3]]
    assert nested_concat(None, b) is b
    many = nested_concat_all([a, b, a])
    assert many["logits"][0].shape == (4, 3) and many["logits"][1].shape == (4,)
    assert concat_padded([torch.ones(2)]).tolist() == [1, 1]


def test_nested_conversions() -> None:
    x = torch.ones(3, 2, requires_grad=True) * 2
    tree = {"a": (x, x.to(torch.bfloat16)), "b": [x.long()], "c": None, "d": "text"}
    assert not nested_detach(tree)["a"][0].requires_grad
    assert nested_to_cpu(tree)["a"][0].device.type == "cpu"
    arr = nested_numpify(tree)
    assert isinstance(arr["a"][0], np.ndarray) and arr["a"][1].dtype == np.float32 and arr["b"][0].dtype == np.int64
    assert arr["c"] is None and arr["d"] == "text"
    cut = nested_truncate(arr, 2)
    assert cut["a"][0].shape == (2, 2) and cut["b"][0].shape == (2, 2)


# -- pad_across_processes with an injected collective -------------------------------------------
def test_pad_across_processes_with_a_fake_gather() -> None:
    calls: list[torch.Tensor] = []

    def fake_gather(t: torch.Tensor) -> torch.Tensor:  # this rank holds (2, 3); the other (2, 5)
        calls.append(t)
        return torch.stack([t, torch.tensor([2, 5])])

    local = torch.arange(6).reshape(2, 3)
    out = pad_across_processes(local, fake_gather, padding_index=-100)
    assert out.tolist() == [[0, 1, 2, -100, -100], [3, 4, 5, -100, -100]]
    assert calls[0].tolist() == [2, 3] and calls[0].dtype == torch.int64
    same = torch.zeros(2, 5)
    assert pad_across_processes(same, fake_gather) is same

    with pytest.raises(ValueError, match="equal batch sizes"):
        pad_across_processes(torch.zeros(3, 5), lambda t: torch.stack([t, torch.tensor([2, 5])]))


def test_gather_across_processes_threads_ragged_lengths() -> None:
    world = FakeWorld(3)

    def rank_fn(rank: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        t = torch.full((2, rank + 1), rank)
        return gather_across_processes({"x": t, "loss": torch.tensor(float(rank))}, gather, padding_index=-1)

    results = world.run(rank_fn)
    for out in results:
        assert out["x"].tolist() == [[0, -1, -1], [0, -1, -1], [1, 1, -1], [1, 1, -1], [2, 2, 2], [2, 2, 2]]
        assert out["loss"].tolist() == [0.0, 1.0, 2.0]


# -- EvalAccumulator ----------------------------------------------------------------------------
def _step_outputs(step: int, bs: int = 2) -> dict[str, Any]:
    seq = 2 + step % 3  # ragged sequence lengths across batches
    ids = torch.arange(step * bs, (step + 1) * bs)
    return {
        "losses": torch.full((bs,), float(step)),
        "predictions": (
            ids[:, None].repeat(1, seq).float().to(torch.bfloat16),
            ids[:, None, None].repeat(1, seq, 3).float(),
        ),
        "label_ids": ids[:, None].repeat(1, seq),
    }


def test_eval_accumulator_flushes_to_numpy_every_k_steps() -> None:
    acc = EvalAccumulator(accumulation_steps=2)
    for step in range(5):
        acc.add(_step_outputs(step))
        leaves = acc.held
        if (step + 1) % 2 == 0:
            assert leaves and all(isinstance(x, np.ndarray) for x in leaves), "after a flush nothing is a tensor"
        else:
            assert any(isinstance(x, torch.Tensor) for x in leaves)
    result = acc.get_arrays()
    assert all(isinstance(x, np.ndarray) for x in acc.held)

    plain = EvalAccumulator()
    for step in range(5):
        plain.add(_step_outputs(step))
    assert any(isinstance(x, torch.Tensor) for x in plain.held), "no accumulation_steps: stays on device"
    expected = plain.get_arrays()
    reference = nested_numpify(nested_concat_all([_step_outputs(s) for s in range(5)]))
    for got, want in [(result, expected), (result, reference)]:
        for g, w in zip(_flat(got), _flat(want)):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype and np.array_equal(g, w)
    assert result["predictions"][0].dtype == np.float32 and result["label_ids"].shape == (10, 4)
    assert result["label_ids"][0].tolist() == [0, 0, -100, -100]


def test_eval_accumulator_without_concat_keeps_batches() -> None:
    acc = EvalAccumulator(do_concat_batches=False, accumulation_steps=3)
    for step in range(4):
        acc.add(_step_outputs(step))
    out = acc.get_arrays()
    assert isinstance(out, list) and len(out) == 4
    assert out[1]["label_ids"].shape == (2, 3) and isinstance(out[1]["label_ids"], np.ndarray)


def test_eval_accumulator_edge_cases() -> None:
    acc = EvalAccumulator(accumulation_steps=1)
    acc.add(None)
    assert acc.get_arrays() is None and acc.steps == 1
    acc = EvalAccumulator()
    for step in range(3):
        acc.add(torch.tensor(float(step)))  # a scalar loss per step
    assert acc.get_arrays().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="gatherer"):
        EvalAccumulator(gather_fn=lambda t: t)
    with pytest.raises(ValueError, match="accumulation_steps"):
        EvalAccumulator(accumulation_steps=0)


def _flat(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _flat(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _flat(v)]
    return [tree]


def _sample_outputs(indices: list[int], rank: int) -> dict[str, Any]:
    """Deterministic per-sample outputs whose padded length depends on the batch (ragged)."""
    seq = 1 + (sum(indices) + rank) % 4
    ids = torch.tensor(indices)
    return {
        "losses": ids.float() / 10,
        "predictions": (ids[:, None].repeat(1, seq).float(), ids.float() * 2),
        "label_ids": ids[:, None].repeat(1, seq),
    }


@pytest.mark.parametrize("n, world, bs", [(16, 3, 2), (7, 2, 3), (5, 4, 1)])
@pytest.mark.parametrize("accumulation_steps", [None, 1, 2])
@pytest.mark.parametrize("do_concat", [True, False])
def test_eval_loop_simulated_world(
    n: int, world: int, bs: int, accumulation_steps: int | None, do_concat: bool
) -> None:
    """The loop exactly as the engine writes it, on `world` threads: results come back in dataset order."""
    fake = FakeWorld(world)

    def eval_loop(rank: int, all_gather: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        sampler = SequentialDistributedSampler(n, world, rank)
        acc = EvalAccumulator(
            -100, do_concat, accumulation_steps, gather_fn=all_gather, gatherer=OrderedGatherer.for_sampler(sampler)
        )
        for batch in batches(list(sampler), bs):
            acc.add(_sample_outputs(batch, rank))
        return acc.get_arrays()

    results = fake.run(eval_loop)
    for got in results:
        merged = got if do_concat else nested_concat_all(got)
        assert merged["predictions"][1].tolist() == [2.0 * i for i in range(n)]
        assert merged["losses"].tolist() == pytest.approx([i / 10 for i in range(n)])
        labels = merged["label_ids"]
        assert labels.shape[0] == n
        for i in range(n):
            row = labels[i]
            assert (row[row != -100] == i).all() and (row != -100).sum() >= 1
            assert (row[: (row != -100).sum()] == i).all(), "padding is on the right"
        if not do_concat:
            assert sum(b["label_ids"].shape[0] for b in got) == n
    for other in results[1:]:
        for a, b in zip(_flat(results[0]), _flat(other)):
            assert np.array_equal(a, b)


# -- restore_order ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_restore_order_layouts(layout: str) -> None:
    n, world = 7, 3
    if layout == "contiguous":
        per_rank_idx = shards(n, world)
    else:  # torch DistributedSampler(shuffle=False, drop_last=False)
        sampler_cls = torch.utils.data.DistributedSampler
        per_rank_idx = [list(sampler_cls(range(n), num_replicas=world, rank=r, shuffle=False)) for r in range(world)]
    per_rank = [
        {"p": np.array(idx), "seq": np.tile(np.array(idx)[:, None], (1, r + 1))} for r, idx in enumerate(per_rank_idx)
    ]
    out = restore_order(per_rank, n, layout)  # type: ignore[arg-type]
    assert out["p"].tolist() == list(range(n))
    assert out["seq"].shape == (n, 3) and (out["seq"][:, 0] == np.arange(n)).all()
    tensors = restore_order([torch.tensor(i) for i in per_rank_idx], n, layout)  # type: ignore[arg-type]
    assert tensors.tolist() == list(range(n))
    with pytest.raises(ValueError, match="layout"):
        restore_order([np.arange(2)], 2, "random")  # type: ignore[arg-type]


# -- outputs ------------------------------------------------------------------------------------
def test_eval_prediction_behaves_like_hf() -> None:
    preds, labels, inputs = np.zeros((2, 3)), np.ones(2), np.arange(2)
    ep = EvalPrediction(predictions=preds, label_ids=labels)
    first, second = ep
    assert first is preds and second is labels and ep[0] is preds and ep[1] is labels and len(ep) == 2
    with pytest.raises(IndexError):
        ep[2]
    ep = EvalPrediction(preds, labels, inputs=inputs)
    assert len(ep) == 3 and ep[2] is inputs and ep[-1] is inputs
    losses = np.ones(2)
    assert EvalPrediction(preds, labels, losses=losses)[2] is losses
    assert "predictions=(2, 3)" in repr(ep)

    out = PredictionOutput(predictions=preds, label_ids=None, metrics={"test_loss": 0.5})
    p2, l2, m2 = out
    assert p2 is preds and l2 is None and m2 == {"test_loss": 0.5}
    loop = EvalLoopOutput(preds, labels, {"eval_loss": 1.0}, num_samples=2)
    assert loop.num_samples == 2 and loop._fields == ("predictions", "label_ids", "metrics", "num_samples")
