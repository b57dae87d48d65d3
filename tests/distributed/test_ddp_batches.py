"""accelerate's data options on 2 real processes (gloo): `split_batches` (the batch is global),
`even_batches: false` (nothing repeated, the last global batch is smaller, no rank waits alone) and
`dispatch_batches` (rank 0 alone reads a stream and sends each rank its slice). Each 2-process run
must end with exactly the weights of one process training on the global batches."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import batches_toy, toy
from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("batches")
    torchrun("worker_batches.py", out, timeout=300)
    return json.loads((out / "results.json").read_text()), load_file(str(out / "results.safetensors"))


@pytest.mark.parametrize("name", ["split", "uneven", "uneven_short", "dispatch", "dispatch_uneven"])
def test_two_ranks_match_one_process_on_the_global_batch(ddp, tmp_path, name):
    results, tensors = ddp
    trainer, model = batches_toy.train(name, str(tmp_path), world=1)
    assert results[name]["ranks_identical"]
    assert results[name]["steps"] == trainer.state.global_step
    torch.testing.assert_close(tensors[name], toy.flat_params(model), rtol=1e-5, atol=1e-6)
    assert results[name]["losses"] == pytest.approx(toy.losses(trainer), rel=1e-5)


def test_split_batches_loads_a_share_of_the_configured_batch(ddp):
    assert [r["batch_size"] for r in ddp[0]["split"]["per_rank"]] == [4, 4]
    assert ddp[0]["split"]["eval_batch_size"] == 4  # per_device_eval_batch_size 8 is global too
    assert ddp[0]["uneven"]["eval_batch_size"] == 8  # without split_batches it is per rank


def test_even_batches_repeats_a_sample_so_it_differs_from_one_process(ddp, tmp_path):
    """The default pads the 23 samples to 24 with a repeated one: the control for `uneven`."""
    results, tensors = ddp
    _, model = batches_toy.train("even", str(tmp_path), world=1)
    assert results["even"]["steps"] == 6
    assert not torch.allclose(tensors["even"], toy.flat_params(model), rtol=1e-5, atol=1e-6)


def test_uneven_batches_leave_out_fewer_samples_than_ranks(ddp):
    """21 samples over 2 ranks x 2: five steps of 4; the one sample left for 2 ranks ends the epoch on both."""
    assert ddp[0]["uneven_short"]["steps"] == 5


@pytest.mark.parametrize("name", ["dispatch", "dispatch_uneven"])
def test_dispatch_batches_only_rank_zero_reads_the_stream(ddp, name):
    results, tensors = ddp
    assert [r["iterations"] for r in results[name]["per_rank"]] == [2, 0]  # two epochs, read by rank 0 only
    # each rank keeps its own half of the first global batch (rows 0, 2, .. and 1, 3, ..)
    stream = torch.stack([item["x"] for item in batches_toy.SCENARIOS[name]["data"]().items[:8]])
    torch.testing.assert_close(tensors[f"{name}_first_0"], stream[0::2])
    torch.testing.assert_close(tensors[f"{name}_first_1"], stream[1::2])


def test_split_batches_needs_a_multiple_of_the_world_size():
    from kiln.engine.data.dispatch_batches import per_rank_batch_size
    from kiln.utils.errors import ConfigError

    assert per_rank_batch_size(8, True, 2, "per_device_train_batch_size") == 4
    assert per_rank_batch_size(8, False, 2, "per_device_train_batch_size") == 8
    with pytest.raises(
        ConfigError,
        match=r"split_batches divides per_device_train_batch_size=7 over 2 ranks; make it a multiple of 2\.",
    ):
        per_rank_batch_size(7, True, 2, "per_device_train_batch_size")


def test_uneven_sampler_shards_without_repeats():
    from kiln.engine.data.samplers import ResumableSampler

    shards = [ResumableSampler(23, seed=1, num_replicas=2, rank=r, even=False, batch_size=2).indices() for r in (0, 1)]
    assert sorted(shards[0] + shards[1]) == list(range(23)) and [len(s) for s in shards] == [12, 11]
    short = [ResumableSampler(21, seed=1, num_replicas=2, rank=r, even=False, batch_size=2) for r in (0, 1)]
    assert [len(s) for s in short] == [10, 10] and len(set(short[0].indices()) | set(short[1].indices())) == 20


@pytest.mark.parametrize("name", ["dispatch", "split"])
def test_resume_mid_epoch_is_exact(ddp, name):
    """Saved at step 3 of 6 and resumed: the same weights as the run that never stopped."""
    assert ddp[0][f"{name}_resume_exact"]
