"""`accelerate launch` with the multi-GPU DDP config file of the Hugging Face docs starts kiln's DDP
(2 processes, on CPU here): the run ends exactly where `kiln fit --nproc 2` ends, and accelerate's
`mixed_precision` is used unless the kiln config sets a precision, which then wins (and says so)."""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.distributed.conftest import run, torchrun
from tests.distributed.toy import write_cli_config
from tests.installed import requires

pytestmark = [pytest.mark.distributed, requires("accelerate")]

# docs: https://huggingface.co/docs/accelerate/basic_tutorials/launch (multi-GPU, one machine)
ACCELERATE_DDP = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: '{mixed}'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
main_process_port: {port}
"""


def _free_port() -> int:
    """accelerate's static rendezvous uses a fixed port (29500), which a previous job may still hold."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _accelerate(tmp_path, name: str, mixed: str, *overrides: str):
    conf = tmp_path / f"{name}-accelerate.yaml"
    conf.write_text(ACCELERATE_DDP.format(mixed=mixed, port=_free_port()))
    cfg = write_cli_config(str(tmp_path / f"{name}.yaml"), str(tmp_path / name))
    return run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.accelerate_cli",
            "launch",
            "--config_file",
            str(conf),
            "-m",
            "kiln.cli",
            "fit",
            cfg,
            *overrides,
        ],
        timeout=180,
    )


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _precision(path) -> str:
    return OmegaConf.load(path / "kiln_config.yaml").precision.name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three 2-process runs of one config for both tests: accelerate with bf16, accelerate with bf16
    under a kiln config that sets fp32, and `kiln fit` on 2 processes (accelerate's `mixed_precision: no`,
    which asks for fp32, is tested in one process: test_environment.py::test_accelerate_no_mixed_precision_changes_nothing)."""
    tmp = tmp_path_factory.mktemp("accelerate")
    used = _accelerate(tmp, "bf16", "bf16")
    kept = _accelerate(tmp, "fp32", "bf16", "precision=fp32")
    torchrun("worker_cli_runs.py", write_cli_config(str(tmp / "own.yaml"), str(tmp / "own")))  # `kiln fit` per rank
    return tmp, used, kept


def test_accelerate_launch_runs_kiln_ddp_like_kiln_fit_on_two_processes(runs):
    tmp, _, _ = runs
    assert _precision(tmp / "own") == _precision(tmp / "fp32") == "fp32"
    # equal weights: `strategy: auto` became DDP over accelerate's 2 processes (one process, or two
    # unsynchronised ones, would see other batches)
    expected, got = _weights(tmp / "own"), _weights(tmp / "fp32")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_accelerate_mixed_precision_applies_unless_the_kiln_config_sets_one(runs):
    tmp, used, kept = runs
    assert "Using precision.name=bf16 from accelerate launch (ACCELERATE_MIXED_PRECISION=bf16)" in used.stderr
    assert _precision(tmp / "bf16") == "bf16"

    assert "but the kiln config sets precision.name=fp32, which wins" in kept.stderr
    assert _precision(tmp / "fp32") == "fp32"
    bf16, fp32 = _weights(tmp / "bf16"), _weights(tmp / "fp32")
    assert any(not torch.equal(bf16[k], fp32[k]) for k in fp32)  # the two runs really trained differently
