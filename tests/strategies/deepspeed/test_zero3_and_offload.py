"""DeepSpeed on 2 CPU processes (gloo), worker_zero3.py in the folder's shared world (conftest.py): optimizer offload (DeepSpeedCPUAdam,
a JIT-compiled op: ~46 s the first time on a quiet machine), zero.Init, load_best_model_at_end and
predict_with_generate under ZeRO-3, and the "auto" scheduler steps of an epoch-based run."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.installed import requires

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.xdist_group("deepspeed-world"),  # conftest.py's ds_world: one world for the folder
    requires("deepspeed"),
]
WORLD_JOB = ("worker_zero3.py", *os.environ.get("KILN_DS3_CHECKS", "").split())


@pytest.fixture(scope="module")
def run(ds_world):
    return ds_world(WORLD_JOB)


def _weights(tensors, prefix):
    found = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + "/")}
    assert found, f"no weights for {prefix}"
    return found


def _close(got, want, tol, what):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=tol, msg=f"{what}: {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_offload_trains_like_no_offload_and_resumes_exactly(run, stage):
    """Offloaded to the CPU, DeepSpeedCPUAdam (kiln's AdamW translated) ends within 1e-5 of kiln's
    torch AdamW without offload (6 steps, accumulation 2, clipping; the two Adams round differently);
    resumed from checkpoint-2 it equals the uninterrupted offload run within 1e-6."""
    results, tensors = run
    got = results[f"offload{stage}"]
    assert got["optimizer"] == "DeepSpeedCPUAdam" and got["offload"] and got["resumed_steps"] == 6
    whole = _weights(tensors, f"offload{stage}/whole")
    _close(whole, _weights(tensors, f"plain{stage}"), 1e-5, f"ZeRO-{stage} offload vs none")
    _close(_weights(tensors, f"offload{stage}/resumed"), whole, 1e-6, f"ZeRO-{stage} offload resume")


@pytest.mark.distributed
def test_offload_with_kiln_torch_optimizer(run):
    """`zero_force_ds_cpu_optimizer: false`: kiln's torch AdamW steps the offloaded partition, as without offload."""
    results, tensors = run
    assert results["offload2_torch"] == {"optimizer": "AdamW", "offload": True}
    _close(_weights(tensors, "offload2_torch"), _weights(tensors, "plain2"), 1e-6, "torch AdamW offload vs none")


@pytest.mark.distributed
def test_zero_init_partitions_at_construction_and_trains_like_zero3(run):
    results, tensors = run
    params = results["zero_init"]
    assert params, "no parameters recorded"
    for name, p in params.items():
        full = math.prod(p["full"])
        assert p["ds_numel"] == full and p["numel"] == 0, name  # the module holds no full tensor
        assert p["local"] == math.ceil(full / 2), name  # each rank holds its half
    _close(_weights(tensors, "zero_init"), _weights(tensors, "plain3"), 1e-6, "zero.Init vs ZeRO-3")


@pytest.mark.distributed
def test_load_best_model_at_end_under_zero3(run):
    """The best checkpoint's weights come back into the partitioned model: equal to DDP's best
    (1e-5, the fp32 parity tolerance), and not the last step's weights."""
    results, tensors = run
    assert results["best_zero3"]["best"] == results["best_ddp"]["best"] == "checkpoint-2"
    assert results["best_zero3"]["eval_losses"][0] > results["best_zero3"]["eval_losses"][-1]
    best, ddp = _weights(tensors, "best_zero3"), _weights(tensors, "best_ddp")
    _close(best, ddp, 1e-5, "best ZeRO-3 vs best DDP")
    last = _weights(tensors, "plain3")  # the same 6 steps without evaluation: the last weights
    assert any(not torch.allclose(best[k], last[k], atol=1e-4) for k in last)


@pytest.mark.distributed
def test_predict_with_generate_under_zero3_equals_one_process(run):
    """Generated ids with partitioned parameters (built under zero.Init, and after training) equal
    generate() in one process on the same weights; rows stop at different lengths, so the ranks
    finish at different steps (synced_gpus keeps them in step)."""
    got = run[0]["generate"]
    assert got["partitioned"]
    for phase in ("before", "after"):
        reference = got["reference"][phase]
        width = max(len(r) for r in reference)
        assert [row for row in got[phase]] == [r + [-100] * (width - len(r)) for r in reference], phase
    assert len({len(r) for r in got["reference"]["before"]}) > 1


@pytest.mark.distributed
def test_auto_scheduler_steps_come_from_the_loop(run):
    """An epoch-based run (no max_steps): DeepSpeed's WarmupDecayLR gets the loop's step count and HF's warmup."""
    got = run[0]["scheduler"]
    assert got["max_steps"] == 10  # 2 epochs x 40 rows / (2 per device x 2 ranks x accumulation 2)
    assert (
        got["total_num_steps"] == got["scheduler_total"] == 10
        and got["warmup_num_steps"] == got["expected_warmup"] == 3
    )
    assert len(got["lrs"]) == 10 and got["lrs"][-1] < got["lrs"][3]  # decays after the warmup
