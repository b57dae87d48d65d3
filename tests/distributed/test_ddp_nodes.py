"""Two simulated nodes on this machine: two torchrun agents with one process each, started as node 0
and node 1 with the command docs/launching.md gives for two machines (`--nnodes 2 --node_rank R
--rdzv_backend c10d --rdzv_endpoint HOST:PORT`, here 127.0.0.1). They train to the weights of one
process with the double batch; node ranks are read from the launcher; `save_on_each_node` makes each
node's local rank 0 write a complete checkpoint to its own disk, `log_on_each_node` decides which
processes log at `log_level`, and only global rank 0 writes tracker runs and history files (node 1's
local rank 0 writes none), as docs/distributed.md's rank table says."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import toy
from tests.distributed.conftest import HERE, REPO

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(
    tmp_path: Path,
    command: list[str],
    results: list[Path],
    flags: tuple[str, ...] = (),
    timeout: float = 150,
    env: dict | None = None,
) -> tuple[list[subprocess.Popen], str]:
    """Start node 0 and node 1 (one torchrun agent each, meeting at 127.0.0.1:<free port> through c10d),
    each running `command` (a script and its arguments, or `-m module ...`) after torchrun's `flags`;
    wait until both exit, or until every file of `results` exists (plus a grace period). Returns the
    agents (ended) and the tail of their logs."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5",
        **(env or {}),
    }
    logs = [open(tmp_path / f"agent{node}.log", "w") for node in (0, 1)]  # files: a full PIPE would block an agent
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=two-nodes",
                "--local_addr=127.0.0.1",
                "--monitor-interval=0.1",
                *flags,
                *command,
            ],
            cwd=REPO,
            env=env,
            stdout=logs[node],
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    deadline, done_at = time.monotonic() + timeout, None
    try:
        # The workers' results decide the test. torchrun's exit barrier between two agents on one host
        # occasionally never completes after both workers have finished, so agents get a grace period, then go.
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if done_at is None and all(r.exists() for r in results):
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > 20:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for fh in logs:
            fh.close()
    return procs, "\n".join((tmp_path / f"agent{node}.log").read_text()[-3000:] for node in (0, 1))


def test_two_nodes_train_like_one_process_and_save_and_log_per_node(tmp_path):
    results = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    procs, agent_logs = two_nodes(tmp_path, [str(HERE / "worker_nodes.py"), str(tmp_path)], results, timeout=480)
    assert all(r.exists() for r in results), agent_logs
    assert all(p.returncode in (0, -9) for p in procs), agent_logs  # -9: killed after the grace period
    # the grace period must not hide a worker that died at exit (e.g. abort: "terminate called ...", -6)
    assert "terminate called" not in agent_logs and "ChildFailedError" not in agent_logs, agent_logs
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r1["node_rank"], r1["num_nodes"], r1["local_rank"], r1["rank"]) == (1, 2, 0, 1)
    assert r0["master_addr"] == r1["master_addr"] == "127.0.0.1"  # the address named, nothing else

    # the two nodes train to the weights of one process with the double batch
    _, model = toy.train_scenario("plain", str(tmp_path / "one"), world=1)
    torch.testing.assert_close(
        load_file(str(tmp_path / "parity.safetensors"))["params"], toy.flat_params(model), rtol=1e-5, atol=1e-6
    )

    for node in (0, 1):  # save_on_each_node: every node holds a complete checkpoint
        files = set(os.listdir(tmp_path / f"node{node}" / "checkpoint-2"))
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "COMPLETE", f"rng_state_{node}.pth"} <= files
    # loggers: node 1's local rank 0 opens no tracker run and writes no history, on its own disk or elsewhere
    assert sorted(os.listdir(tmp_path / "node1")) == ["checkpoint-2"]
    runs = tmp_path / "node0" / "runs"  # the logging dir: history files and one tensorboard run
    assert {"metrics.csv", "metrics.jsonl"} <= set(os.listdir(runs))
    assert len([d for d in runs.iterdir() if d.is_dir()]) == 1
    assert len([d for d in (tmp_path / "shared" / "runs").iterdir() if d.is_dir()]) == 1
    shared = set(os.listdir(tmp_path / "shared" / "checkpoint-2"))  # one writer, every rank's RNG
    assert {"model.safetensors", "COMPLETE", "rng_state_0.pth", "rng_state_1.pth"} <= shared

    assert r0["each_node"] == {"level": logging.INFO, "world_zero": True, "local_zero": True}
    assert r1["each_node"] == {"level": logging.INFO, "world_zero": False, "local_zero": True}
    assert r0["shared"]["level"] == logging.INFO and r1["shared"]["level"] == logging.ERROR
