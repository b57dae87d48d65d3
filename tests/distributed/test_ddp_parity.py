"""DDP on 2 processes x batch b ends where 1 process with batch 2b ends (with and without
accumulation, with token-level losses whose item counts differ per rank), logs the same losses, and
gathers evaluation predictions in dataset order from an uneven dataset."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import toy
from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    torchrun("worker_parity.py", out)
    return json.loads((out / "results.json").read_text()), load_file(str(out / "results.safetensors"))


@pytest.mark.parametrize("name", [n for n, sc in toy.SCENARIOS.items() if "reference" not in sc])
def test_ddp_matches_one_process_with_double_batch(ddp, tmp_path, name):
    results, tensors = ddp
    trainer, model = toy.train_scenario(name, str(tmp_path), world=1)
    assert results[name]["strategy"] == "DDPStrategy" and results[name]["wrapped"] == "DistributedDataParallel"
    assert results[name]["ranks_identical"]
    torch.testing.assert_close(tensors[name], toy.flat_params(model), rtol=1e-5, atol=1e-6)
    # logged losses are the mean over every item of the global batch, not a mean of rank means
    assert results[name]["losses"] == pytest.approx(toy.losses(trainer), rel=1e-5)
    assert results[name]["train_loss"] == pytest.approx(trainer.state.log_history[-1]["train_loss"], rel=1e-5)


def test_without_average_tokens_across_devices_ranks_means_are_averaged(ddp, tmp_path):
    """One SGD step: the update is lr x the mean of the two ranks' own mean-loss gradients, which
    differs from the mean over all tokens because the ranks hold different numbers of tokens."""
    from torch.utils.data import default_collate

    from kiln.engine.data.samplers import ResumableSampler

    results, tensors = ddp
    name = "tokens_rank_means"
    assert results[name]["ranks_identical"]
    data = toy.SCENARIOS[name]["data"]()
    torch.manual_seed(0)
    model = toy.SCENARIOS[name]["model"]()
    start = toy.flat_params(model).clone()
    grads, counts = [], []
    for rank in (0, 1):
        batch = default_collate(
            [data[i] for i in ResumableSampler(len(data), seed=3, num_replicas=2, rank=rank).indices()[:2]]
        )
        model.zero_grad()
        model.training_step(batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        counts.append(int(batch["labels"].ne(-100).sum()))
    assert counts[0] != counts[1]  # otherwise both normalisations agree and this proves nothing
    torch.testing.assert_close(tensors[name], start - 0.5 * (grads[0] + grads[1]) / 2, rtol=1e-5, atol=1e-6)
    token_mean = start - 0.5 * (grads[0] * counts[0] + grads[1] * counts[1]) / sum(counts)
    assert not torch.allclose(tensors[name], token_mean, rtol=1e-4, atol=1e-5)


def test_float8_ranks_scale_their_own_shards_and_average_gradients(ddp):
    """precision fp8 under DDP ends bitwise where torchao by hand ends when each of two shards gets its own
    float8 scales and the gradients are averaged, which differs from one process scaling the whole batch."""
    from tests.precision.float8_models import hand_float8_sgd

    results, tensors = ddp
    if "fp8_shards" not in results:
        pytest.skip("torchao is not installed")
    assert results["fp8_shards"]["ranks_identical"] and results["fp8_shards"]["float8_layers"] == 2
    assert results["fp8_shards"]["wrapped"] == "DistributedDataParallel"
    data = toy.SCENARIOS["fp8_shards"]["data"]()
    shards = hand_float8_sgd(data, steps=4, batch=4, world=2, lr=0.05, seed=3, recipe="tensorwise")
    assert torch.equal(tensors["fp8_shards"], toy.flat_params(shards))
    whole = hand_float8_sgd(data, steps=4, batch=8, world=1, lr=0.05, seed=3, recipe="tensorwise")
    assert not torch.equal(tensors["fp8_shards"], toy.flat_params(whole))


@pytest.mark.parametrize("batch", [1, 3])
def test_eval_gathers_predictions_in_dataset_order(ddp, batch):
    results, tensors = ddp
    model = toy.Regressor()
    torch.nn.utils.vector_to_parameters(tensors["eval_params"], model.parameters())
    data = toy.regression_data(7, seed=11)
    x = torch.stack([d["x"] for d in data])
    y = torch.stack([d["y"] for d in data])
    with torch.no_grad():
        expected = model(x)
    assert results[f"eval_b{batch}"]["num_predictions"] == 7  # the sampler's padding duplicate is dropped
    torch.testing.assert_close(tensors[f"pred_b{batch}"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tensors[f"labels_b{batch}"], y)
    if batch == 1:  # one sample per batch: the eval loss is exactly the mean over the 7 samples
        assert results["eval_b1"]["eval_loss"] == pytest.approx(float(((expected - y) ** 2).mean()), rel=1e-5)


def test_rank_queries(ddp):
    results, _ = ddp
    assert results["ranks"] == [{"rank": 0, "world": True, "local": True}, {"rank": 1, "world": False, "local": False}]


@pytest.mark.parametrize("name", ["short_window", "tokens_short_window"])
def test_short_window_scenarios_end_each_epoch_on_a_window_of_one(tmp_path, name):
    """The scenarios above only cover the short window if every epoch really ends on one: 5
    micro-batches per epoch with accumulation 2 are windows of 2, 2, 1, so 3 steps per epoch."""
    trainer, _ = toy.train_scenario(name, str(tmp_path), world=1)
    epochs = {h["step"]: h["epoch"] for h in trainer.state.log_history if "loss" in h}
    assert len(toy.SCENARIOS[name]["data"]()) == 20
    assert epochs[3] == 1.0 and epochs[6] == 2.0 and epochs[2] == pytest.approx(0.8)
