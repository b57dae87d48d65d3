"""Elastic restarts with automatic resume (issue 32 item 2): a 2-process DDP job whose workers are
SIGKILLed three times, at seeded random steps on either rank, is restarted by the launcher's elastic
agent (`kiln fit --nproc 2 --max-restarts 3`, or `torchrun --max-restarts 3`); with
`resume_from_checkpoint: if_exists` every attempt resumes from the newest complete checkpoint by
itself, the job exits 0, and the final weights and logged losses equal the uninterrupted run's, bit
for bit. Without `if_exists` nothing resumes on its own (HF never does), and a restarted attempt says so."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import run, torchrun

pytestmark = pytest.mark.distributed

MAX_STEPS, SAVE_STEPS = 12, 2
#: kill steps are drawn from these windows, one per attempt: each attempt gets past the last one's checkpoint
WINDOWS = ((2, 4), (5, 8), (9, 11))
ENV = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}  # a survivor stuck in a collective is SIGKILLed after 5 s, not 30


def write_config(path: str, output_dir: str, **data_args) -> str:
    from omegaconf import OmegaConf

    cfg = {
        "output_dir": output_dir,
        "seed": 5,
        "learning_rate": 1e-2,
        "max_steps": MAX_STEPS,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "save_steps": SAVE_STEPS,
        "logging_steps": 1,
        "disable_tqdm": True,
        "report_to": "none",
        "strategy": {"name": "ddp", "device": "cpu", "timeout": 60},
        "task": {
            "model": "tests.distributed.toy:cli_model",
            "data": "tests.distributed.worker_elastic:data",
            "data_args": data_args,
        },
    }
    OmegaConf.save(OmegaConf.create(cfg), path)
    return path


def seeded_kills(seed: int) -> list[tuple[int, int, int]]:
    """(attempt, rank, step) of each kill: a random rank at a random step of each window."""
    rng = random.Random(seed)
    return [(attempt, rng.choice((0, 1)), rng.randint(*window)) for attempt, window in enumerate(WINDOWS)]


def _losses(output_dir) -> list[float]:
    with open(os.path.join(output_dir, "trainer_state.json")) as fh:
        return [h["loss"] for h in json.load(fh)["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference run: `kiln fit` on a 2-process world forked by tests/world.py (its launcher is not
    what it checks; the restarted runs below go through the real elastic agent)."""
    root = tmp_path_factory.mktemp("elastic")
    out = root / "straight"
    torchrun("worker_cli_runs.py", write_config(str(root / "straight.yaml"), str(out)), timeout=300)
    return out


def _launch(launcher: str, cfg: str, *overrides: str, restarts: int = 3):
    if launcher == "kiln":
        cmd = [sys.executable, "-m", "kiln.cli", "fit", cfg, "--nproc", "2", f"--max-restarts={restarts}"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            f"--max-restarts={restarts}",
            "--monitor-interval=0.1",
            "-m",
            "kiln.cli",
            "fit",
            cfg,
        ]
    return run([*cmd, *overrides], timeout=600, check=False, env=ENV)


@pytest.mark.parametrize("launcher, seed", [("kiln", 32), pytest.param("torchrun", 7, marks=pytest.mark.heavy)])
def test_three_kills_restart_resume_and_end_bit_identical(tmp_path, uninterrupted, launcher, seed):
    kills = seeded_kills(seed)
    marks, out = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    cfg = write_config(
        str(tmp_path / "c.yaml"), str(out), folder=str(marks), kills=[":".join(map(str, k)) for k in kills]
    )
    proc = _launch(launcher, cfg, "resume_from_checkpoint=if_exists")
    log = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, log
    for attempt, rank, step in kills:  # every kill happened, on the rank and step drawn
        assert (marks / f"killed-{attempt}").read_text() == f"{rank}:{step}", log
        # the next attempt started from the newest checkpoint before the kill (the kill came before step's save)
        assert int((marks / f"start-{attempt + 1}").read_text()) == SAVE_STEPS * ((step - 1) // SAVE_STEPS), log
    assert not (marks / "killed-3").exists() and int((marks / "start-0").read_text()) == 0

    expected, got = load_file(str(uninterrupted / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), log
    assert _losses(out) == _losses(uninterrupted) and len(_losses(out)) == MAX_STEPS


def test_without_if_exists_a_restart_does_not_resume_and_says_how(tmp_path):
    """HF never resumes on its own, so neither does kiln by default: the restarted attempt is told to set
    `if_exists`, and is refused because the first attempt left checkpoints in output_dir."""
    marks, out = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    cfg = write_config(str(tmp_path / "c.yaml"), str(out), folder=str(marks), kills=["0:1:3"])
    proc = _launch("kiln", cfg, restarts=1)
    assert proc.returncode != 0 and (marks / "killed-0").exists()
    assert not (marks / "start-1").exists()  # refused before training, not trained from step 0 over checkpoint-2
    assert "This is restart 1 of the job" in proc.stderr and "resume_from_checkpoint=if_exists" in proc.stderr
    assert "already holds checkpoints" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.heavy
def test_two_nodes_on_one_host_restart_and_resume_bit_identical(tmp_path, uninterrupted):
    """The same under two torchrun agents (node 0 and node 1, one process each, c10d at 127.0.0.1): a
    worker killed on either node makes both agents restart their workers, which resume."""
    from tests.distributed.test_ddp_nodes import two_nodes

    rng = random.Random(11)
    kills = [(rng.choice((0, 1)), rng.randint(*window)) for window in WINDOWS[:2]]
    marks, out = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    cfg = write_config(str(tmp_path / "c.yaml"), str(out), folder=str(marks), once=[f"{r}:{s}" for r, s in kills])
    procs, log = two_nodes(
        tmp_path,
        ["-m", "kiln.cli", "fit", cfg, "resume_from_checkpoint=if_exists"],
        [out / "model.safetensors", out / "trainer_state.json"],
        flags=("--max-restarts=3",),
        timeout=600,
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )  # a fresh store per attempt (launching.md)
    assert all(p.returncode in (0, -9) for p in procs), log  # -9: killed after the grace period (see two_nodes)
    assert all((marks / f"killed-{r}-{s}").exists() for r, s in kills), log
    starts = [int(line) for line in (marks / "starts").read_text().split()]
    assert starts[0] == 0 and starts == sorted(starts), starts
    assert {SAVE_STEPS * ((s - 1) // SAVE_STEPS) for _, s in kills} <= set(starts), (starts, kills)
    expected, got = load_file(str(uninterrupted / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), log
    assert _losses(out) == _losses(uninterrupted)
