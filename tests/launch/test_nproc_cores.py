"""`kiln fit --nproc N` with more processes than CPU cores on a machine without a GPU: one warning sentence,
once, and the job still starts (issue 52 item 17). The cores are the process's affinity (a container's or
`taskset`'s share), which also sizes each worker's OMP_NUM_THREADS."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from kiln import cli


@pytest.fixture
def started(monkeypatch, tmp_path):
    """No job is started: what torch's elastic launcher would have been asked for."""
    import torch.distributed.launcher.api as api

    seen: dict = {}

    def fake_elastic_launch(config, entrypoint):
        seen.update(nproc=config.nproc_per_node, omp=os.environ.get("OMP_NUM_THREADS"))
        return lambda *args: None

    monkeypatch.setattr(api, "elastic_launch", fake_elastic_launch)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    OmegaConf.save(OmegaConf.create({"output_dir": "out"}), tmp_path / "c.yaml")
    return seen


@pytest.mark.parametrize("nproc, warned, omp", [(3, True, "1"), (2, False, "1"), (1, False, None)])
def test_more_processes_than_cores_is_warned_once(started, capsys, nproc, warned, omp):
    flags = ["--nproc", str(nproc)] if nproc != 1 else ["--max-restarts", "1"]  # 1: the launcher runs only with a flag
    assert cli.main(["fit", "c.yaml", *flags]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    if warned:
        assert err == [
            "kiln: warning: 3 processes on 2 CPU cores take turns on the cores, so they train slower than 2 "
            "processes (--nproc 2) would."
        ]
    else:
        assert err == []
    assert started["nproc"] == nproc
    assert started["omp"] == (omp or "2")  # each worker's threads: the cores shared out, at least 1


def test_a_machine_with_a_gpu_is_not_warned(started, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["fit", "c.yaml", "--nproc", "3"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_cores_are_the_affinity_not_the_machine(monkeypatch):
    from kiln.launch import local

    monkeypatch.setattr(
        os, "sched_getaffinity", lambda pid: {3} if pid == 0 else set(range(8)), raising=False
    )  # 0: this process
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert local.cpu_cores() == 1
    monkeypatch.delattr(os, "sched_getaffinity")
    assert local.cpu_cores() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # undeterminable: one core
    assert local.cpu_cores() == 1
