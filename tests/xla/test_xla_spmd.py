"""`strategy: xla_fsdp` (SPMD FSDPv2) on 2 PJRT CPU devices in one process: the same numbers as one
device, parameters really sharded, bit-for-bit resume from its sharded checkpoint, `kiln convert` and
`save_model()` give the full weights, and HF's fsdp_config form (auto-wrap by class, gradient
checkpointing) trains the same. The SPMD runs happen in spmd_worker.py (one subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_xla")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from kiln import Trainer  # noqa: E402
from kiln.engine.checkpoint.convert import convert_checkpoint  # noqa: E402
from tests.xla.spmd_cases import config, model, train_data  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("spmd")
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": "2",
        "PYTHONPATH": os.path.dirname(os.path.dirname(HERE)),
    }
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "spmd_worker.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out, torch.load(out / "results.pt")


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    trainer = Trainer(
        model(), config(str(tmp_path_factory.mktemp("cpu")), strategy="single"), train_dataset=train_data()
    )
    trainer.fit()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _close(a, b):
    # the same maths, partitioned by the XLA compiler: equal up to float32 rounding
    return set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5) for k in a)


def test_spmd_on_two_devices_matches_one_device(runs, cpu_reference):
    _, results = runs
    assert results["devices"] == 2
    assert "devices=[2,1]" in results["sharding"]  # the first weight is split over both devices
    assert _close(results["full"], cpu_reference)


def test_resume_from_the_sharded_checkpoint_is_exact(runs):
    out, results = runs
    assert os.path.isdir(out / "full" / "checkpoint-3" / "xla_dcp")
    # what the checkpoint restores (weights, every optimizer state tensor) is bit for bit what was saved
    saved, loaded = results["full_at_3"], results["resumed_at_3"]
    assert saved.keys() == loaded.keys() and any(k.startswith("optim.") for k in saved)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    # the steps after it replay the uninterrupted run's graphs, so they are bit for bit too (the
    # optimizer priming's zero gradients, left in place, made the first one a different graph: 9e-10)
    full, resumed = results["full"], results["resumed"]
    assert full.keys() == resumed.keys() and all(torch.equal(resumed[k], full[k]) for k in full)
    assert results["resumed_compiled"] == 0  # the same graphs: every step after the load was a cache hit


def test_convert_and_save_model_give_the_full_weights(runs, tmp_path):
    out, results = runs
    converted = load_file(convert_checkpoint(str(out / "full" / "checkpoint-6"), str(tmp_path / "converted")))
    exported = load_file(str(out / "model" / "model.safetensors"))
    for state in (converted, exported):
        assert state.keys() == results["full"].keys()
        assert all(torch.equal(state[k], results["full"][k]) for k in state)


def test_hf_fsdp_config_with_wrap_and_gradient_checkpointing_trains_the_same(runs, cpu_reference):
    _, results = runs
    assert results["wrapped_strategy"] == ("xla_fsdp", True)
    assert _close(results["wrapped"], cpu_reference)
