"""FSDP on 2 processes against DDP on 2 and one process with the same global batch: token-level
loss with uneven token counts per rank, gradient accumulation 2, clipping on every step. Every
sharding option, CPU offload, size-based and default wrapping, activation checkpointing, prefetch
and the HF argument forms give DDP's weights exactly on this CPU (asserted at 1e-5 as the issue
asks), DDP's logged losses and the same global grad norm; bf16 mixed precision within 6e-2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.strategies.fsdp import cases
from tests.strategies.fsdp.conftest import torchrun

pytestmark = pytest.mark.distributed

SAME_AS_DDP = [
    "full_shard",
    "shard_grad_op",
    "no_shard",
    "hybrid_shard",
    "hybrid_shard_1",
    "hybrid_shard_zero2",
    "offload",
    "min_num_params",
    "default_wrap",
    "activation_checkpointing",
    "forward_prefetch",
    "hf",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_parity")
    torchrun(2, "worker.py", out, "ddp", *SAME_AS_DDP, "ddp_activation_checkpointing", "bf16", timeout=900)
    results = json.loads((out / "results.json").read_text())
    tensors = load_file(str(out / "tensors.safetensors"))
    by_case: dict = {}
    for key, value in tensors.items():
        case, name = key.split("/", 1)
        by_case.setdefault(case, {})[name] = value
    return results, by_case


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return cases.run_case("single", str(tmp_path_factory.mktemp("single")), 1)


def _assert_weights(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want) and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_full_shard_matches_ddp_and_one_process(runs, single):
    results, weights = runs
    assert results["full_shard"]["strategy"] == "FSDPStrategy" and results["ddp"]["strategy"] == "DDPStrategy"
    _assert_weights(weights["full_shard"], weights["ddp"], 1e-5)
    _assert_weights(weights["full_shard"], single[1], 1e-5)
    assert results["full_shard"]["losses"] == pytest.approx(single[0]["losses"], rel=1e-5)
    # the clipped norm is the global one over all shards, as DDP's over full gradients
    assert all(n > 0.3 for n in results["ddp"]["grad_norms"])  # every step really clips
    assert results["full_shard"]["grad_norms"] == pytest.approx(results["ddp"]["grad_norms"], rel=1e-5)


@pytest.mark.parametrize("case", SAME_AS_DDP[1:])
def test_option_matches_ddp(runs, case):
    results, weights = runs
    assert results[case]["strategy"] == "FSDPStrategy"
    _assert_weights(weights[case], weights["ddp"], 1e-5)
    assert results[case]["losses"] == pytest.approx(results["ddp"]["losses"], rel=1e-5)
    assert results[case]["grad_norms"] == pytest.approx(results["ddp"]["grad_norms"], rel=1e-5)


def test_activation_checkpointing_section_keeps_ddp_and_fsdp_weights(runs):
    """The config's activation_checkpointing section on both blocks, under DDP (full) and FSDP (selective)."""
    results, weights = runs
    assert results["ddp_activation_checkpointing"]["strategy"] == "DDPStrategy"
    assert (
        results["ddp_activation_checkpointing"]["checkpointed"]
        == results["activation_checkpointing"]["checkpointed"]
        == 2
    )
    assert results["ddp"]["checkpointed"] == 0
    _assert_weights(weights["ddp_activation_checkpointing"], weights["ddp"], 1e-6)
    assert results["ddp_activation_checkpointing"]["losses"] == pytest.approx(results["ddp"]["losses"], rel=1e-6)


def test_bf16_mixed_precision_trains_close_to_fp32(runs):
    results, weights = runs
    assert results["bf16"]["precision"] == "FSDPBF16MixedPrecision"  # autocast replaced by the FSDP policy
    _assert_weights(weights["bf16"], weights["ddp"], 6e-2)
    assert results["bf16"]["losses"] == pytest.approx(results["ddp"]["losses"], abs=2e-2)


def test_no_reduce_scatter_inside_an_accumulation_window(tmp_path):
    """6 optimizer steps x 2 micro-batches, 3 FSDP units: one reduce-scatter per unit per step (not
    per micro-batch)."""
    torchrun(2, "worker_sync.py", tmp_path)
    assert json.loads((tmp_path / "count.json").read_text()) == {"reduce_scatters": 6 * 3, "steps": 6}
