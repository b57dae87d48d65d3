"""A cluster kind kiln does not know, added from outside kiln in this one file: a class that reads
made-up FAKECLUSTER_* variables plus one `register` line. `detect()` returns its topology, and two
plain `python` processes that carry only those variables (no torchrun, no RANK / WORLD_SIZE) train
with DDP and end where one process with the double batch ends.

Run as a script, this file is one of the two workers: `python test_custom_cluster.py OUT`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # as a worker script, only this folder is on sys.path
    sys.path.insert(0, str(REPO))

from kiln.launch.environment import ClusterEnvironment, ClusterKind, Env, detect, register  # noqa: E402


class FakeCluster(ClusterKind):
    name = "fakecluster"

    @classmethod
    def detects(cls, env: Env) -> bool:
        return "FAKECLUSTER_RANK" in env

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        world = int(env["FAKECLUSTER_WORLD_SIZE"])
        return ClusterEnvironment(
            world_size=world,
            rank=int(env["FAKECLUSTER_RANK"]),
            local_rank=int(env["FAKECLUSTER_LOCAL_RANK"]),
            local_world_size=world,
            source=cls.name,
            main_address=env["FAKECLUSTER_ADDR"],
            main_port=int(env["FAKECLUSTER_PORT"]),
            rendezvous=True,
        )


register(FakeCluster)

# every variable a known launcher or scheduler sets: the workers must be found by FakeCluster alone
KNOWN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "CROSS_RANK",
    "LOCAL_SIZE",
)
FAKE = {
    "FAKECLUSTER_RANK": "1",
    "FAKECLUSTER_WORLD_SIZE": "2",
    "FAKECLUSTER_LOCAL_RANK": "1",
    "FAKECLUSTER_ADDR": "127.0.0.1",
    "FAKECLUSTER_PORT": "29999",
}


def test_detect_returns_the_registered_kinds_topology():
    env = detect(FAKE)
    assert (env.source, env.world_size, env.rank, env.local_rank) == ("fakecluster", 2, 1, 1)
    assert env.distributed and env.launched and env.init_method == "tcp://127.0.0.1:29999"
    assert detect({}).source == "none"  # a kind is asked only when its own variables are there
    assert detect({**FAKE, "WORLD_SIZE": "4", "RANK": "0"}).source == "torchrun"  # after the built-in kinds


def test_two_plain_processes_train_like_one_process(tmp_path):
    import torch
    from safetensors.torch import load_file

    from tests.distributed import toy

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in KNOWN and not k.startswith(("SLURM_", "ACCELERATE_", "FSDP_", "FAKECLUSTER_"))
    }
    base.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = []
    for rank in (0, 1):
        env = {
            **base,
            "FAKECLUSTER_RANK": str(rank),
            "FAKECLUSTER_WORLD_SIZE": "2",
            "FAKECLUSTER_LOCAL_RANK": str(rank),
            "FAKECLUSTER_ADDR": "127.0.0.1",
            "FAKECLUSTER_PORT": str(port),
        }
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, __file__, str(tmp_path)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=180))
        finally:
            proc.kill()
            log.close()
    output = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    assert codes == [0, 0], output
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"source": "fakecluster", "world_size": 2, "strategy": "DDPStrategy", "ranks_identical": True}
    _, model = toy.train_scenario("plain", str(tmp_path / "one"), world=1)
    torch.testing.assert_close(
        load_file(str(tmp_path / "params.safetensors"))["params"], toy.flat_params(model), rtol=1e-5, atol=1e-6
    )


if __name__ == "__main__":
    from safetensors.torch import save_file

    from tests.distributed import toy

    out = sys.argv[1]
    trainer, model = toy.train_scenario("plain", os.path.join(out, "two"), world=2)
    flat = toy.flat_params(model)
    every = trainer.strategy.all_gather(flat)
    if trainer.is_world_process_zero():
        save_file({"params": flat.contiguous()}, os.path.join(out, "params.safetensors"))
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(
                {
                    "source": detect().source,
                    "world_size": trainer.strategy.world_size,
                    "strategy": type(trainer.strategy).__name__,
                    "ranks_identical": bool((every == every[0]).all()),
                },
                fh,
            )
