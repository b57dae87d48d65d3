"""data.packing under context parallelism on real gloo process groups: a tiny SDPA Llama on packed
rows (bfd, rows of up to 22 tokens: the split pads some to a multiple of 4) trains under cp 2 --
load balanced (torch's head-tail pieces) and contiguous -- exactly as on one process: the same
weights, logged losses, grad norms (clipping at 1.0), eval loss, every micro-batch's
num_items_in_batch (real targets only: no example's last token predicts the next one's first) and
num_input_tokens_seen (the rows' tokens before the split, not the padding it adds), with
accumulation 2; dp_shard 2 x cp 2 on 4 processes (`heavy`) too. Under cp each layer's keys and
values are gathered over the cp ranks and every query is masked to its own example
(kiln/strategies/mesh/packed_cp.py). The packed run itself equals the unpacked (padded) one step
for step: tests/engine/packing/test_fit.py."""

from __future__ import annotations

import pytest

from tests.installed import requires
from tests.strategies.model_parallel import cp_cases
from tests.strategies.model_parallel.test_model_parallel import _same_run as same_run
from tests.strategies.model_parallel.test_model_parallel import _same_weights, _torchrun

pytestmark = [pytest.mark.distributed, requires("transformers")]
TOL = 1e-5


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return cp_cases.run_case("packed_single", str(tmp_path_factory.mktemp("packed_single")))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _torchrun(2, tmp_path_factory.mktemp("packed_two"), "packed_cp2", "packed_cp2_contiguous")


@pytest.mark.parametrize("case", ["packed_cp2", "packed_cp2_contiguous"])
def test_packed_rows_under_cp2_train_like_one_process(two, single, case):
    results, weights = two
    got, (reference, reference_weights) = results[case], single
    assert (got["data_shards"], got["item_shards"], got["grad_divisor"]) == (1, 2, 2)
    assert any(n > 1.0 for n in reference["grad_norms"])  # clipping at 1.0 really acts
    same_run(got, reference, TOL)  # losses, grad norms, eval loss
    assert got["items"] == reference["items"]  # num_items_in_batch: each real target once
    # the batch's input tokens before the split, as HF counts them: not the padding the split adds
    assert got["tokens_seen"] == reference["tokens_seen"] > 0
    _same_weights(weights[case], reference_weights, TOL)


@pytest.mark.heavy
def test_packed_rows_under_dp_shard2_x_cp2_train_like_one_process(tmp_path, single):
    """Each data shard packs the rows the sampler deals it; its 2 cp ranks split them."""
    results, weights = _torchrun(4, tmp_path, "packed_dp2cp2")
    got, (reference, reference_weights) = results["packed_dp2cp2"], single
    assert (got["data_shards"], got["item_shards"], got["grad_divisor"]) == (2, 4, 4)
    same_run(got, reference, TOL)
    assert got["items"][:8] == reference["items"][:8]  # training's; evaluation's follow, per data shard
    assert got["tokens_seen"] == reference["tokens_seen"] > 0
    _same_weights(weights["packed_dp2cp2"], reference_weights, TOL)
