"""DeepSpeed checks that parity with DDP cannot make (worker_schedule_and_files.py, in the folder's shared 2-process world: conftest.py):

- with a `scheduler` in the DeepSpeed config, the learning rate of every step is that scheduler stepped
  exactly once per optimizer step (kiln steps it; if DeepSpeed's engine also did, it would run twice
  as fast - both runs would still agree with each other, so only the exact sequence shows it);
- a ZeRO-3 checkpoint holds model.safetensors with the full weights, so `kiln evaluate`, `from_pretrained`
  and a plain `load_state_dict` use it without DeepSpeed (ZeRO-3's own model file holds no weights)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.installed import requires

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.xdist_group("deepspeed-world"),  # conftest.py's ds_world
    requires("deepspeed"),
]
WORLD_JOB = ("worker_schedule_and_files.py",)


@pytest.fixture(scope="module")
def run(ds_world):
    return ds_world(WORLD_JOB)


def _expected_lrs(params: dict, steps: int) -> list[float]:
    """The rate each step uses, for DeepSpeed's WarmupDecayLR stepped once after every step."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=params["warmup_max_lr"])
    scheduler = WarmupDecayLR(optimizer, **params)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs


def test_deepspeed_scheduler_is_stepped_once_per_optimizer_step(run):
    got = run[0]["schedule"]
    params = got["params"]
    assert (
        params["warmup_min_lr"],
        params["warmup_max_lr"],
        params["warmup_num_steps"],
        params["total_num_steps"],
    ) == (0, 0.01, 4, 8)
    assert got["steps"] == 8
    want = _expected_lrs(params, 8)
    # linear warm-up over 4 steps to 0.01, then linear decay to 0 at step 8 (each value is the rate the step used)
    assert want == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.0075, 0.005])
    assert got["lrs"] == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_a_zero3_checkpoint_loads_without_deepspeed(run, tmp_path):
    from safetensors.torch import load_file

    from kiln import Trainer
    from tests.strategies.contract.scenarios import ContractNet, config

    results, tensors = run
    ckpt = results["zero3"]["checkpoint"]
    live = {k[len("zero3/") :]: v for k, v in tensors.items() if k.startswith("zero3/")}
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
    saved = load_file(os.path.join(ckpt, "model.safetensors"))
    plain = ContractNet()
    plain.load_state_dict(saved, strict=True)  # every weight, full shapes (not ZeRO-3's empty placeholders)
    for name, value in live.items():
        torch.testing.assert_close(plain.state_dict()[name].float(), value, rtol=0, atol=0, msg=name)
    # as `kiln evaluate` loads it: through a one-process strategy's CheckpointIO, no DeepSpeed engine
    trainer = Trainer(ContractNet(), config(str(tmp_path), "eval", 1, strategy={"name": "single", "device": "cpu"}))
    trainer._load_from_checkpoint(ckpt)
    for name, value in live.items():
        torch.testing.assert_close(trainer.model.state_dict()[name].float(), value, rtol=0, atol=0, msg=name)
