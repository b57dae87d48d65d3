"""`save.async_save` under DDP (2 processes, gloo): rank 0 writes the checkpoint in the background while
both ranks train on; the run ends bit-identical to a synchronous one, and a run killed right after an
asynchronous checkpoint resumes from it (through `kiln fit --nproc 2`) and ends bit-identical too."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from kiln.engine.checkpoint.files import is_complete, list_checkpoints
from tests.distributed.conftest import kiln_cli, torchrun
from tests.distributed.toy import write_cli_config

# heavy: the writer-rank rules are tested in a fake 2-rank world (test_async_save.py), kills in test_async_kill.py
pytestmark = [pytest.mark.distributed, pytest.mark.heavy]


def _async(path: str) -> str:
    cfg = OmegaConf.load(path)
    cfg.save = {"async_save": True}
    OmegaConf.save(cfg, path)
    return path


def _weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model.safetensors"))


def test_async_save_under_ddp_matches_sync_and_resumes_bit_identically(tmp_path):
    sync, full, run = tmp_path / "sync", tmp_path / "async", tmp_path / "run"
    job = torchrun(
        "worker_cli_runs.py",
        write_cli_config(str(tmp_path / "sync.yaml"), str(sync)),
        _async(write_cli_config(str(tmp_path / "async.yaml"), str(full))),
        _async(write_cli_config(str(tmp_path / "kill.yaml"), str(run), kill_at=3)),
        timeout=240,
    )
    for out in (full, run):
        saved = list_checkpoints(str(out))
        assert saved and all(is_complete(path) for _, path in saved), out
    assert [os.path.basename(p) for _, p in list_checkpoints(str(run))] == ["checkpoint-3"]
    assert not (run / "model.safetensors").exists()  # the job really ended at step 3
    assert not any(name.endswith(".tmp") for name in os.listdir(full))
    assert "cannot be written in the background" not in job.stdout + job.stderr  # DDP's format stages: really async

    resume = _async(write_cli_config(str(tmp_path / "resume.yaml"), str(run)))
    kiln_cli("fit", resume, "--nproc", "2", "resume_from_checkpoint=true", timeout=240)

    expected = _weights(sync)
    for out in (full, run):
        got = _weights(out)
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), out
    for name in ("checkpoint-3", "checkpoint-6"):  # the checkpoints themselves hold the synchronous run's weights
        a, b = load_file(str(sync / name / "model.safetensors")), load_file(str(full / name / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
