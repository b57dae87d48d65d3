"""Context parallelism on real gloo process groups with a token-local model (cp_cases.TokenLocalLM: no
attention, so splitting the sequence is exact on CPU, where torch has no ring attention) against
`single` with the same global batch (accumulation 2, clipping at 1.0, rows of varying real length,
so the cp chunks hold different numbers of items): cp 2 -- load balanced (torch's head-tail pieces)
and contiguous -- gives single's weights, logged losses, grad norms, eval loss, every micro-batch's
num_items_in_batch and num_input_tokens_seen at 1e-5 (each token counted once); bf16 stays within
bf16's rounding of single bf16; a cp 2 checkpoint resumes on one process. dp_shard 2 x cp 2 and
cp 2 x tp 2 on 4 processes are `heavy`. A tiny SDPA Llama with cp 2 against single runs only with 2+ CUDA devices
(ring attention needs CUDA's SDPA kernels)."""

from __future__ import annotations

import pytest
import torch

from tests.strategies.model_parallel import cp_cases
from tests.strategies.model_parallel.test_model_parallel import _checkpoint, _same_weights, _torchrun
from tests.strategies.model_parallel.test_model_parallel import _same_run as same_run

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return cp_cases.run_case("cp_single", str(tmp_path_factory.mktemp("cp_single")))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_two")
    return (*_torchrun(2, out, "cp2", "cp2_contiguous", "cp2_bf16"), out)


def _same_run(result: dict, reference: dict, tol: float = TOL) -> None:
    same_run(result, reference, tol)  # losses (each token counted once), global grad norms, eval loss
    assert result["items"] == reference["items"]  # num_items_in_batch: the global window's items, once each
    assert result["tokens_seen"] == reference["tokens_seen"]


@pytest.mark.parametrize("case", ["cp2", "cp2_contiguous"])
def test_cp2_trains_like_one_process(two, single, case):
    results, weights, _ = two
    got = results[case]
    assert (got["data_shards"], got["item_shards"], got["grad_divisor"]) == (1, 2, 2)
    assert any(n > 1.0 for n in single[0]["grad_norms"])  # clipping at 1.0 really acts
    assert (
        len(single[0]["items"]) == 8 and single[0]["tokens_seen"] == 4 * 2 * 4 * cp_cases.LENGTH
    )  # steps x micro x rows
    _same_run(got, single[0])
    _same_weights(weights[case], single[1])


def test_cp2_bf16_trains_like_single_bf16(two, tmp_path):
    """bf16 under cp is FSDP2's MixedPrecisionPolicy over dp_shard_cp (bf16 compute, fp32 reduction;
    the policy itself: test_mesh_layout's cp world). SGD, so a weight's change is its gradient's."""
    results, weights, _ = two
    reference = cp_cases.run_case("cp_single_bf16", str(tmp_path))
    got = results["cp2_bf16"]
    assert got["losses"] == pytest.approx(reference[0]["losses"], rel=1e-2)
    assert got["items"] == reference[0]["items"]
    init = {k: v.float() for k, v in cp_cases.TokenLocalLM().state_dict().items()}
    for name, want in reference[1].items():  # the difference, relative to how far training moved the weight
        error = (weights["cp2_bf16"][name] - want).norm() / (want - init[name]).norm()
        assert error < 5e-2, f"{name}: differs from single bf16 by {error:.2e} of its change"


def test_a_cp2_checkpoint_resumes_on_one_process(two, tmp_path):
    """DCP reshards the dp_shard_cp shards onto one process: the loaded weights are the saved ones bit for
    bit (`_at_` stops where it loaded) and the continued run ends where cp 2's own run did."""
    from kiln.strategies.mesh.checkpoint_io import ShardedCheckpointIO

    results, weights, out = two
    checkpoint = _checkpoint(out, "cp2")
    resumed, resumed_weights = _torchrun(1, tmp_path, f"cp_one_from_cp2={checkpoint}", f"cp_one_at_cp2={checkpoint}")
    saved = ShardedCheckpointIO.consolidate(str(checkpoint))
    assert resumed["cp_one_at_cp2"]["steps"] == 2 and set(saved) == set(resumed_weights["cp_one_at_cp2"])
    for name, value in saved.items():
        assert torch.equal(resumed_weights["cp_one_at_cp2"][name], value.float()), name
    go_on = resumed["cp_one_from_cp2"]
    assert go_on["steps"] == 4 and go_on["losses"] == pytest.approx(results["cp2"]["losses"], rel=TOL)
    _same_weights(resumed_weights["cp_one_from_cp2"], weights["cp2"])


@pytest.mark.heavy
def test_dp_shard2_x_cp2_on_four_processes_trains_like_one(tmp_path, single):
    results, weights = _torchrun(4, tmp_path, "dp2cp2")
    got = results["dp2cp2"]
    assert (got["data_shards"], got["item_shards"], got["grad_divisor"]) == (2, 4, 4)
    _same_run(got, single[0])
    _same_weights(weights["dp2cp2"], single[1])


@pytest.mark.heavy
def test_cp2_x_tp2_on_four_processes_trains_like_one(tmp_path, single):
    """cp and tp together: the MLP split over tp inside each cp rank's chunk (cp_cases.TOKEN_PLAN; the
    layout itself: test_mesh_layout's cp x tp world). Both tp ranks of a cp position train on the same
    chunk; items, tokens and the loss count once per cp chunk, not once per tp rank."""
    results, weights = _torchrun(4, tmp_path, "cp2tp2")
    got = results["cp2tp2"]
    assert (got["data_shards"], got["item_shards"], got["grad_divisor"]) == (1, 2, 2)
    _same_run(got, single[0])
    _same_weights(weights["cp2tp2"], single[1])


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="ring attention needs 2 CUDA devices (torch has no CPU kernel)"
)
def test_llama_sdpa_cp2_on_cuda_trains_like_one_gpu(tmp_path):
    """Never run on this project's CPU machines: the ring attention itself (torch's flash/efficient
    SDPA handlers), with the attention-mask hook and head-tail load balancing."""
    results, weights = _torchrun(2, tmp_path, "llama_cp2_cuda")
    reference = cp_cases.run_case("llama_single_cuda", str(tmp_path / "single"))
    _same_run(results["llama_cp2_cuda"], reference[0], tol=1e-4)
    _same_weights(weights["llama_cp2_cuda"], reference[1], 1e-4)
