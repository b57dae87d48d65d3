"""Sequence parallel and loss parallel over tp 2 on real gloo process groups (one 2-process job for
all cases), the tiny Llama of cases.py against `single` with the same global batch
(accumulation 2, clipping at 1.0): losses, global grad norms, eval loss and weights at 1e-5. Beside
parity, what it cannot see (probes.py): under sequence parallel the norms, the blocks' inputs and
the rowwise layers' outputs are split by sequence (Shard(1), half the tokens each) while the
colwise layers get the whole sequence, and the norms' weights are DTensors replicated on tp; under
loss parallel the training logits are a vocab-split DTensor (local last dim V/tp) whose forward and
backward run inside torch's loss_parallel(), while evaluation gets whole logits; a TrainingModule
asking the Llama for tuples (return_dict=False) gets its loss as a plain tensor too. Checkpoints
resume with sequence and loss parallel switched off and on. dp_shard 2 x tp 2 with both runs on 4
processes (heavy). The layout decisions: test_sequence_parallel_plan.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.strategies.model_parallel import cases
from tests.strategies.model_parallel.test_model_parallel import _same_run, _same_weights, _torchrun

pytestmark = pytest.mark.distributed
CASES = ("tp2_sp", "tp2_lp", "tp2_sp_lp", "tp2_lp_tuple")
#: (the run that resumes, the run that saved): sequence and loss parallel switched off, and on
RESUMES = [("tp2", "tp2_sp_lp"), ("tp2_sp_lp", "tp2_lp")]
SEQUENCE = 8  # tokens per sample (cases.data); the training batch is 4 samples, evaluation 1
HALF = ["Shard(dim=1)"]  # split by sequence over tp


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return cases.run_case("single", str(tmp_path_factory.mktemp("single")))


def _checkpoint(out: Path, case: str) -> Path:
    return out / "runs" / case / "checkpoint-2"


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The cases, then each of RESUMES in the same job: `<run>_from_<saved>` trains on to step 4 from
    the saved run's step-2 checkpoint, `<run>_at_<saved>` stops where it loaded."""
    out = tmp_path_factory.mktemp("sp_lp")
    resumes = [f"{run}_{how}_{saved}={_checkpoint(out, saved)}" for run, saved in RESUMES for how in ("from", "at")]
    results, weights = _torchrun(2, out, *CASES, *resumes)
    return results, weights, out


@pytest.fixture(scope="module")
def tuple_single(tmp_path_factory):
    return cases.run_case("tuple_single", str(tmp_path_factory.mktemp("tuple_single")))


@pytest.mark.parametrize("case", CASES)
def test_trains_like_one_process(two, request, case):
    results, weights, _ = two
    # TupleLlama's loss is its micro-batch's mean, the plain Llama's a sum over the window's items (and SGD)
    single = request.getfixturevalue("tuple_single" if case.endswith("_tuple") else "single")
    norms = 2 * 2 + 1 if "_sp" in case else 0  # SequenceParallel makes the norms' weights tp DTensors too
    assert results[case]["data_shards"] == 1 and results[case]["tp_split"] == 2 * 7 + 2 + norms
    assert any(n > 1.0 for n in single[0]["grad_norms"])  # clipping at 1.0 really acts
    _same_run(results[case], single[0])
    _same_weights(weights[case], single[1])


def _seen(results: dict, case: str, place: str) -> tuple:
    p = results[case]["probe"][place]
    return p["placements"], p["local"], p["global"]


@pytest.mark.parametrize("case", ["tp2_sp", "tp2_sp_lp"])
@pytest.mark.parametrize("mode, batch", [("train", 4), ("eval", 1)])
def test_sequence_parallel_splits_the_residual_stream_by_sequence(two, case, mode, batch):
    results = two[0]
    half, whole = [batch, SEQUENCE // 2, 32], [batch, SEQUENCE, 32]
    # the embedding's and each rowwise layer's output reach the next norm split by sequence (reduce-scatter)
    for norm in (
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.norm",
    ):
        assert _seen(results, case, f"{mode} {norm} input") == (HALF, half, whole), norm
    for block in ("model.layers.0.self_attn", "model.layers.0.mlp"):
        assert _seen(results, case, f"{mode} {block} input") == (HALF, half, whole), block  # the norm's output
        assert _seen(results, case, f"{mode} {block} output") == (HALF, half, whole), block  # o_proj / down_proj
    # inside the block the colwise layers see every token (the all-gather), as a plain tensor
    assert _seen(results, case, f"{mode} model.layers.0.self_attn.q_proj input") == (None, whole, whole)
    params = results[case]["params"]
    assert params["model.norm.weight"] == params["model.layers.0.input_layernorm.weight"] == [["tp"], ["Replicate()"]]


def test_without_sequence_parallel_the_stream_stays_whole(two):
    results = two[0]
    whole = [4, SEQUENCE, 32]
    assert _seen(results, "tp2_lp", "train model.layers.0.input_layernorm input") == (None, whole, whole)
    assert _seen(results, "tp2_lp", "train model.layers.0.mlp output") == (None, whole, whole)  # all-reduced whole
    assert results["tp2_lp"]["params"]["model.norm.weight"] is None  # plain weights


@pytest.mark.parametrize("case", ["tp2_lp", "tp2_sp_lp", "tp2_lp_tuple"])
def test_loss_parallel_keeps_training_logits_split_by_vocabulary(two, case):
    results = two[0]
    probe = results[case]["probe"]
    assert _seen(results, case, "train logits") == (
        ["Shard(dim=2)"],
        [4, SEQUENCE, cases.VOCAB // 2],
        [4, SEQUENCE, cases.VOCAB],
    )
    assert probe["train loss_parallel in forward"] and probe["train loss_parallel in backward"]
    assert probe["train loss type"] == "Tensor"  # the model's replicated DTensor loss reaches the engine as a tensor
    # evaluation: no loss_parallel(), and the head gathers the logits whole as before
    assert _seen(results, case, "eval logits") == (None, [1, SEQUENCE, cases.VOCAB], [1, SEQUENCE, cases.VOCAB])
    assert probe["eval loss_parallel in forward"] is False
    assert results[case]["params"]["lm_head.weight"] == [["tp"], ["Shard(dim=0)"]]
    if case.endswith("_tuple"):  # the tuple keeps its logits beside the loss made a plain tensor
        assert results[case]["tuple"] == [[], [4, SEQUENCE, cases.VOCAB]]


@pytest.mark.parametrize("run, saved", RESUMES, ids=[f"{s}_to_{r}" for r, s in RESUMES])
def test_a_checkpoint_resumes_with_sequence_and_loss_parallel_switched(two, run, saved):
    """Sequence parallel makes the norms' weights tp DTensors (Replicate), without it they are plain
    tensors; loss parallel changes no parameter. DCP loads one into the other: the weights arrive
    bit for bit (`_at_` stops where it loaded) and the continued run ends within 1e-6 of the saved
    run's uninterrupted one (the layouts differ only in the order of float sums)."""
    from kiln.strategies.mesh.checkpoint_io import ShardedCheckpointIO

    results, weights, out = two
    go_on, stop = f"{run}_from_{saved}", f"{run}_at_{saved}"
    assert results[stop]["steps"] == 2 and results[go_on]["steps"] == 4
    saved_weights = ShardedCheckpointIO.consolidate(str(_checkpoint(out, saved)))
    assert set(saved_weights) == set(weights[stop])
    for name, value in saved_weights.items():
        assert torch.equal(weights[stop][name], value.float()), f"{name} changed on the way from {saved} to {run}"
    assert results[go_on]["losses"] == pytest.approx(results[saved]["losses"], rel=1e-6)
    assert results[go_on]["grad_norms"][2:] == pytest.approx(results[saved]["grad_norms"][2:], rel=1e-6)
    _same_weights(weights[go_on], weights[saved], 1e-6)


def test_without_loss_parallel_the_head_gathers_the_vocabulary(two):
    results = two[0]
    whole = [4, SEQUENCE, cases.VOCAB]
    assert _seen(results, "tp2_sp", "train logits") == (None, whole, whole)
    assert results["tp2_sp"]["probe"]["train loss_parallel in forward"] is False


@pytest.mark.heavy
def test_dp_shard2_x_tp2_with_both_on_four_processes_trains_like_one(tmp_path: Path, single):
    results, weights = _torchrun(4, tmp_path, "dp2tp2_sp_lp")
    got = results["dp2tp2_sp_lp"]
    assert got["data_shards"] == 2 and got["tp_split"] == 2 * 7 + 2 + 2 * 2 + 1
    _same_run(got, single[0])
    _same_weights(weights["dp2tp2_sp_lp"], single[1])
    # per data shard: 2 samples, each rank half of their tokens; FSDP shards the norms' tp-replicated weights
    assert got["probe"]["train model.norm input"]["placements"] == HALF
    assert got["probe"]["train model.norm input"]["local"] == [2, SEQUENCE // 2, 32]
    assert got["probe"]["train logits"]["local"] == [2, SEQUENCE, cases.VOCAB // 2]
    assert got["params"]["model.norm.weight"] == [["dp_shard", "tp"], ["Shard(dim=0)", "Replicate()"]]
