"""Issue 34 (7b, 11): every way of building a model trains under ZeRO-3 exactly as without ZeRO, or is
refused before training; and `strategy: deepspeed` runs in one plain `python` process.

One launch of worker_model_building.py as a plain process (no launcher, world size 1): that it runs
at all is the check of item 11 (it used to stop after ~150 s of JIT-compiling DeepSpeed's shared-memory
all-reduce with an AssertionError about LOCAL_RANK presented as a config problem). With one process
ZeRO-3 partitions, gathers and steps as with several, and the reference (`single`) sees the same batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.installed import requires
from tests.world import python_path

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.xdist_group("deepspeed-world"),  # conftest.py's ds_world: one world for the folder
    requires("deepspeed"),
]
WORLD_JOB = ("worker_model_building.py", "gpt2", "plain", "pretrained")  # run2's checks

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "NODE_RANK",
)
WAYS = [
    ("class", 1),
    ("class", 0),
    ("from_config", 1),
    ("from_config", 0),
    ("plain", 1),
    ("pretrained", 1),
    ("pretrained", 0),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_build")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    env.update(
        PYTHONPATH=python_path(),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "worker_model_building.py"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(f"worker exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    from safetensors.torch import load_file

    return json.loads((out / "results.json").read_text()), load_file(str(out / "tensors.safetensors"))


@pytest.fixture(scope="module")
def run2(ds_world):
    return ds_world(WORLD_JOB)


def _weights(tensors: dict, prefix: str) -> dict:
    found = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + "/")}
    assert found, f"no weights for {prefix}"
    return found


def _close(got: dict, want: dict, tol: float, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=tol, msg=f"{what}: {name}")


@pytest.mark.slow
@pytest.mark.parametrize("way,zero_init", WAYS, ids=[f"{w}-zero_init{z}" for w, z in WAYS])
def test_zero3_trains_like_single(run, way, zero_init):
    """`GPT2LMHeadModel(config)` used to keep torch's default init under kiln's zero.Init (loss ~18
    instead of 3.84 here; 40 in the issue). Now each way starts from the reference's weights (1e-6),
    logs its losses (1e-5) and ends with its weights (1e-4: ZeRO-3 sums gradients in another order, and
    Adam turns that into ~1.6e-5 on near-zero bias gradients); zero.Init partitions at construction."""
    results, tensors = run
    key, ref = f"{way}/zero3_init{zero_init}", f"{way}/reference"
    assert results[key]["partitioned_at_build"] is bool(zero_init)
    _close(_weights(tensors, f"{key}/initial"), _weights(tensors, f"{ref}/initial"), 1e-6, f"{key} initial")
    assert results[key]["losses"] == pytest.approx(results[ref]["losses"], abs=1e-5)
    assert results[key]["eval_loss"] == pytest.approx(results[ref]["eval_loss"], abs=1e-5)
    _close(_weights(tensors, f"{key}/final"), _weights(tensors, f"{ref}/final"), 1e-4, f"{key} final")


@pytest.mark.slow
@pytest.mark.parametrize("zero_init", [1, 0])
def test_from_pretrained_under_zero3_starts_from_the_saved_weights(run, zero_init):
    _, tensors = run
    _close(
        _weights(tensors, f"pretrained/zero3_init{zero_init}/initial"),
        _weights(tensors, "pretrained/saved"),
        0.0,
        "loaded",
    )


@pytest.mark.slow
def test_transformers_first_imported_inside_the_factory_is_refused(run):
    """zero.Init was entered before Transformers existed, so its initialisation could not be
    gathered: one sentence before training instead of a model trained from torch's default init."""
    results, _ = run
    assert results["transformers_before"] is False  # the scenario is real: nothing imported it earlier
    message = results["late_import"]["refused"]
    assert message and message.startswith(
        "GPT2LMHeadModel was built under ZeRO-3's zero.Init before Transformers was imported"
    )
    assert (
        "import transformers before creating the Trainer" in message and message.replace("e.g.", "eg").count(". ") == 0
    )


@pytest.mark.slow
def test_model_partitioned_outside_kiln_is_refused_by_zero2(run):
    results, _ = run
    assert results["mismatch"]["refused"].startswith(
        "The model's parameters are partitioned by deepspeed.zero.Init (ZeRO-3) but the DeepSpeed config runs ZeRO-2"
    )


@pytest.mark.slow
def test_one_process_without_launcher_skips_the_shm_op_build(run):
    """The whole worker ran in one plain process; DeepSpeed's CPU shared-memory all-reduce (only used
    by AutoTP inference) was not JIT-compiled on the way."""
    results, _ = run
    assert results["world"] == 1
    assert results["shm_comm_op_built"] is False


@pytest.mark.distributed
@pytest.mark.parametrize("way,zero_init", WAYS, ids=[f"{w}-zero_init{z}" for w, z in WAYS])
def test_zero3_on_two_processes_trains_like_ddp(run2, way, zero_init):
    """The same on 2 processes against DDP: every rank runs the initialisation (the RNG advances as
    without ZeRO) and rank 0's values are kept, so each rank's partition is a slice of one tensor."""
    results, tensors = run2
    key, ref = f"{way}/zero3_init{zero_init}", f"{way}/reference"
    assert results["world"] == 2 and results[key]["partitioned_at_build"] is bool(zero_init)
    _close(_weights(tensors, f"{key}/initial"), _weights(tensors, f"{ref}/initial"), 1e-6, f"{key} initial")
    assert results[key]["losses"] == pytest.approx(results[ref]["losses"], abs=1e-5)
    _close(_weights(tensors, f"{key}/final"), _weights(tensors, f"{ref}/final"), 1e-4, f"{key} final")
