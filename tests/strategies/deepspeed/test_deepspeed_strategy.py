"""DeepSpeed on 2 CPU processes (gloo): several checks on worker.py's results (run in the folder's one
shared 2-process world, conftest.py's ds_world)."""

from __future__ import annotations

import pytest
import torch

from tests.installed import requires

pytestmark = [
    pytest.mark.xdist_group("deepspeed-world"),  # conftest.py's ds_world: one world for the folder
    requires("deepspeed"),
]
WORLD_JOB = ("worker.py",)


@pytest.fixture(scope="module")
def run(ds_world):
    return ds_world(WORLD_JOB)


def _weights(tensors, prefix):
    return {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + "/")}


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_fp32_matches_ddp(run, stage):
    """Same global batch, accumulation 2, clipping 0.5, uneven token counts: the same weights as DDP
    (1e-5), the same losses and DeepSpeed's grad norm equal to DDP's."""
    results, tensors = run
    ddp, zero = _weights(tensors, "ddp"), _weights(tensors, f"zero{stage}")
    assert ddp and set(ddp) == set(zero)
    for name in ddp:
        torch.testing.assert_close(zero[name], ddp[name], rtol=1e-5, atol=1e-5, msg=f"ZeRO-{stage} {name}")
    for field in ("losses", "grad_norms"):
        assert len(results[f"zero{stage}"][field]) == len(results["ddp"][field]) == 6
        torch.testing.assert_close(
            torch.tensor(results[f"zero{stage}"][field]), torch.tensor(results["ddp"][field]), rtol=1e-5, atol=1e-6
        )
    assert abs(results[f"zero{stage}"]["eval_loss"] - results["ddp"]["eval_loss"]) < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_trains_and_evaluates(run, stage):
    got = run[0][f"bf16_zero{stage}"]
    assert got["param_dtype"] == "torch.bfloat16" and got["moved"] > 1e-3
    assert 0.0 < got["eval_loss"] < 10.0


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_exact_and_convert_gives_the_live_weights(run, stage):
    """Resumed from checkpoint-2 equals the uninterrupted run (tolerance 1e-6: DeepSpeed restores the
    fp32 master weights and Adam state bit for bit on the same process count); `convert` equals the
    live full weights."""
    results, tensors = run
    assert results[f"resume_zero{stage}"]["steps"] == 6
    whole, resumed = _weights(tensors, f"resume_zero{stage}/whole"), _weights(tensors, f"resume_zero{stage}/resumed")
    converted = _weights(tensors, f"resume_zero{stage}/converted")
    assert whole and set(whole) == set(resumed) == set(converted)
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(converted[name], whole[name], rtol=0, atol=0, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpoint_in_another_param_group_layout_is_refused_clearly(run, stage):
    """DeepSpeed partitions optimizer state per param group, so older kiln's one-group checkpoints (kept
    without weight decay) cannot resume in today's two groups (HF's layout): one sentence says so."""
    error = run[0][f"layout_zero{stage}"]["error"]
    assert error.startswith("CheckpointError: ") and "1 parameter groups and this run's optimizer has 2" in error
    assert "resume with the kiln version that saved it" in error
