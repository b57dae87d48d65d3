"""Every feature works under both presets of the mesh strategy, `fsdp` and `model_parallel` (issue 53):
tensor parallelism, activation checkpointing (also with tp), CPU offload, per-block compilation (also
with tp) and fp16 (with FSDP, and with tp alone, where TP-split gradients sit beside whole ones). One
2-process gloo job runs each feature under both presets, the mesh written in each preset's own words.

Each run ends with `single`'s weights, losses and global grad norms at 1e-5 (fp16: with single fp16's
losses within fp16's rounding), the two presets of a feature end bitwise equal (one strategy), and the
feature really acted: the TP-split parameters, the checkpointed and compiled block forwards, the
offload policy of every FSDP unit, the sharded loss scaler (an inf in one element of rank 0's
gradient skips that step on both ranks). What a preset cannot do on a mesh is refused under both in
the same sentence (test_refusals.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.strategies.case_jobs import start
from tests.strategies.mesh import cases

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve().parent
NAMES = [f"{preset}_{feature}" for feature in cases.FEATURES for preset in ("fsdp", "mp")]
FP32 = [f for f in cases.FEATURES if not f.startswith("fp16")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return start(HERE / "worker.py", tmp_path_factory.mktemp("mesh_features"), NAMES)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return cases.run_case("single", str(tmp_path_factory.mktemp("single")), 1)


@pytest.fixture(scope="module")
def single_fp16(tmp_path_factory):
    from kiln.accelerators import cpu

    supports = cpu.cpu_supports_fp16
    cpu.cpu_supports_fp16 = lambda: True  # torch computes fp16 on any CPU; kiln refuses it there for speed only
    try:
        return cases.run_case("single_fp16", str(tmp_path_factory.mktemp("single_fp16")), 1)
    finally:
        cpu.cpu_supports_fp16 = supports


def _same_weights(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want) and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("feature", FP32)
def test_each_feature_trains_like_one_process_under_both_presets(runs, single, feature):
    results, weights = runs
    fsdp, mp = f"fsdp_{feature}", f"mp_{feature}"
    assert results[fsdp]["strategy"] == "FSDPStrategy" and results[mp]["strategy"] == "ModelParallelStrategy"
    assert all(n > 0.3 for n in single[0]["grad_norms"])  # every step really clips
    for name in (fsdp, mp):
        _same_weights(weights[name], single[1], 1e-5)
        assert results[name]["losses"] == pytest.approx(single[0]["losses"], rel=1e-5)
        assert results[name]["grad_norms"] == pytest.approx(single[0]["grad_norms"], rel=1e-5)
    for name in weights[fsdp]:  # one strategy: the two presets of one mesh compute the same numbers
        assert torch.equal(weights[fsdp][name], weights[mp][name]), name
    assert results[fsdp]["losses"] == results[mp]["losses"]


@pytest.mark.parametrize("preset", ["fsdp", "mp"])
def test_each_feature_really_acted(runs, preset):
    results, _ = runs
    got = {feature: results[f"{preset}_{feature}"] for feature in cases.FEATURES}
    for feature, run in got.items():
        tp = cases.FEATURES[feature][2]
        # tp 2 over both processes: up's weight and bias split, down's weight split and its bias a replicated
        # DTensor on tp, in both blocks; one data shard, and no FSDP (tp alone)
        assert (run["tp_split"], run["data_shards"]) == ((8, 1) if tp else (0, 2)), feature
        # the two blocks (the root unit is kiln's step dispatcher around the module)
        assert run["fsdp_units"] == (0 if tp else 2), feature
    assert got["ac"]["checkpointed"] == got["ac_tp"]["checkpointed"] == 2 and got["tp"]["checkpointed"] == 0
    assert got["compile"]["compiled"] == got["compile_tp"]["compiled"] == 2 and got["ac"]["compiled"] == 0
    assert got["offload"]["offload"] == ["CPUOffloadPolicy"] and got["ac"]["offload"] == ["OffloadPolicy"]


def test_fp16_under_both_presets(runs, single_fp16):
    """FSDP's MixedPrecisionPolicy (fp16 compute, fp32 reduction) and tp alone's autocast both keep the
    loss scale with a scaler whose inf check spans every rank."""
    results, weights = runs
    for preset in ("fsdp", "mp"):
        dp, tp = results[f"{preset}_fp16"], results[f"{preset}_fp16_tp"]
        assert dp["precision"] == "FSDPFP16MixedPrecision" and tp["precision"] == "FP16MixedPrecision"
        assert dp["scaler"] == tp["scaler"] == "ShardedLocalGradScaler"
        assert dp["skipped_per_rank"] == [0, 0] and dp["losses"] == pytest.approx(single_fp16[0]["losses"], rel=1e-2)
        assert dp["losses"] != pytest.approx(single_fp16[0]["losses"], rel=1e-7)  # really fp16, not fp32
        # the inf only rank 0's gradient shard held: both ranks skipped that step, and the others trained
        assert tp["skipped_per_rank"] == [1, 1] and all(torch.isfinite(torch.tensor(tp["losses"])))
    for feature in ("fp16", "fp16_tp"):
        for name in weights[f"fsdp_{feature}"]:
            assert torch.equal(weights[f"fsdp_{feature}"][name], weights[f"mp_{feature}"][name]), (feature, name)
