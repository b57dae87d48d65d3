"""A LoRA model under DDP and FSDP (2 processes, gloo on CPU): only the adapter trains (the base
weights stay bit for bit what they were), the adapter matches the one-process run with the same
global batch within 1e-6, each checkpoint holds the adapter only, and resuming a fresh model from
the step-2 checkpoint ends with the uninterrupted run's weights exactly. FSDP2 shards each GPT2Block
holding frozen and trainable parameters together (HF/accelerate's FSDP1 wraps each LoRA layer in
a unit of its own instead, since a flat parameter cannot mix them)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import torchrun
from tests.distributed.worker_peft import base_model, lora_model, run_case
from tests.installed import requires

pytestmark = [pytest.mark.distributed, requires("peft")]

CASES = ("ddp", "fsdp", "fsdp_full")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("peft_2proc")
    torchrun("worker_peft.py", out, *CASES, timeout=900)
    results = json.loads((out / "results.json").read_text())
    by_case: dict = {}
    for key, value in load_file(str(out / "tensors.safetensors")).items():
        case, run, name = key.split("/", 2)
        by_case.setdefault(case, {}).setdefault(run, {})[name] = value
    return results, by_case


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_case("single", str(tmp_path_factory.mktemp("peft_single")), 1)


def _split(weights: dict) -> tuple[dict, dict]:
    lora = {k: v for k, v in weights.items() if "lora_" in k}
    return lora, {k: v for k, v in weights.items() if k not in lora}


@pytest.mark.parametrize("case", CASES)
def test_only_the_adapter_trains_and_matches_one_process(job, single, case):
    results, tensors = job
    lora, base = _split(tensors[case]["straight"])
    want_lora, _ = _split({k.split("/", 1)[1]: v for k, v in single[1].items() if k.startswith("straight/")})
    start, _ = _split(lora_model().state_dict())
    assert lora and lora.keys() == want_lora.keys() == start.keys()
    initial = {f"base_model.model.{k}": v for k, v in base_model().state_dict().items()}
    for name, value in base.items():  # frozen: exactly the pretrained weights
        assert torch.equal(value, initial[name.replace(".base_layer", "")]), f"{case}: base weight {name} changed"
    for name in lora:
        assert not torch.equal(lora[name], start[name]), f"{case}: {name} did not train"
        torch.testing.assert_close(
            lora[name], want_lora[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{case} {n}: {m}"
        )
    assert results[case]["losses"] == pytest.approx(single[0]["losses"], abs=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_holds_the_adapter_and_resume_is_exact(job, case):
    results, tensors = job
    assert results[case]["strategy"] == ("DDPStrategy" if case == "ddp" else "FSDPStrategy")
    assert results[case]["format"] == "peft-adapter" and results[case]["sharded"] == (case != "ddp")
    if case != "ddp":  # each GPT2Block is a unit of frozen and trainable parameters together
        assert len(results[case]["mixed_units"]) == 2, results[case]["mixed_units"]
    files = set(results[case]["files"])
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin", "fsdp_dcp"}
    straight, resumed = tensors[case]["straight"], tensors[case]["resumed"]
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), f"{case}: {name} differs after resume"
    assert (
        results[case]["resumed_losses"] == results[case]["losses"]
    )  # the history before step 2 comes from the checkpoint
