"""Precision under FSDP on 2 processes. fp16: the loss scaler is FSDP's sharded one (kiln's
ShardedLocalGradScaler), and an inf in one element of rank 0's gradient shard (invisible to rank 1
locally) skips that step on BOTH ranks and halves the scale on both; the other steps train. bf16-true: the local shards are bf16 and it
trains. (Checked by hand: with a scaler whose inf check stays local, rank 1 steps and the test fails.)"""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def precision_runs(shared_job):  # worker_precision.py, in the job conftest.shared_job starts
    return json.loads((shared_job / "precision" / "result.json").read_text())


def test_fp16_inf_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(precision_runs):
    ranks = precision_runs["fp16"]
    for r in ranks:
        assert r["precision"] == "FSDPFP16MixedPrecision" and r["scaler"] == "ShardedLocalGradScaler" and r["sharded"]
        poisoned = r["steps"][1]
        assert not poisoned["changed"] and poisoned["scale_after"] == poisoned["scale_before"] / 2
        assert r["skipped"] == 1
        others = r["steps"][:1] + r["steps"][2:]
        assert all(s["changed"] and s["scale_after"] == s["scale_before"] for s in others)  # fp16 trains
        assert all(math.isfinite(x) for x in r["losses"])
    assert ranks[0]["losses"] == ranks[1]["losses"]


def test_bf16_true_shards_bf16_parameters_and_trains(precision_runs):
    for r in precision_runs["bf16-true"]:
        assert r["precision"] == "BF16TruePrecision" and r["shard_dtypes"] == ["torch.bfloat16"] and r["sharded"]
        assert all(s["changed"] for s in r["steps"]) and all(math.isfinite(x) for x in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
