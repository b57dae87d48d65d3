"""`kiln fit --nproc` without starting a job: what the launcher binds to (127.0.0.1 only, issue 32
item 4), how often the job was restarted as the cluster environment reads it (torchrun's elastic
restarts, SLURM requeues), `--max-restarts` handed to torch's agent, and which attempt's failure the
launcher reports."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import psutil
import pytest

from kiln import cli
from kiln.launch import local
from kiln.launch.environment import detect


def test_the_launch_config_meets_on_loopback_with_kilns_rendezvous():
    config = local.launch_config(2)
    assert config.local_addr == "127.0.0.1"  # the address the agent advertises: the workers' MASTER_ADDR
    assert config.rdzv_backend == "kiln-loopback" and (config.min_nodes, config.max_nodes) == (1, 1)
    assert config.max_restarts == 0 and "SIGTERM" not in config.signals_to_handle  # kiln forwards SIGTERM itself
    assert local.launch_config(2, max_restarts=3, handle_sigterm=True).max_restarts == 3
    assert "SIGTERM" in local.launch_config(2, handle_sigterm=True).signals_to_handle


def test_the_rendezvous_store_listens_on_127_0_0_1_only():
    store = local._loopback_store()
    try:
        listening = [
            c.laddr
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
        ]
        assert [addr.ip for addr in listening] == ["127.0.0.1"], listening
        assert store.host == "127.0.0.1"
    finally:
        del store


@pytest.mark.parametrize(
    "env, count",
    [
        ({}, 0),
        ({"TORCHELASTIC_RESTART_COUNT": "0", "WORLD_SIZE": "2", "RANK": "1"}, 0),
        (
            {"TORCHELASTIC_RESTART_COUNT": "3", "WORLD_SIZE": "2", "RANK": "1"},
            3,
        ),  # torchrun, kiln --nproc --max-restarts
        ({"SLURM_RESTART_COUNT": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, 1),  # a requeued srun job
        ({"SLURM_RESTART_COUNT": "2"}, 2),  # a requeued one-task job: no launcher, still restarted
        ({"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "2", "WORLD_SIZE": "2", "RANK": "0"}, 3),
        ({"TORCHELASTIC_RESTART_COUNT": "", "SLURM_RESTART_COUNT": "x"}, 0),
    ],
)
def test_restart_count_is_read_from_whoever_restarted_the_job(env, count):
    assert detect(env).restart_count == count


def test_max_restarts_reaches_the_launcher(monkeypatch):
    seen = {}

    def fake_launch(nproc, argv, *, extra_env=None, max_restarts=0, **kw):
        seen.update(nproc=nproc, argv=argv, max_restarts=max_restarts)
        return 0

    monkeypatch.setattr(local, "launch_local", fake_launch)
    assert cli.main(["fit", "cfg.yaml", "--nproc", "2", "--max-restarts", "3", "seed=1"]) == 0
    assert seen == {"nproc": 2, "argv": ["-m", "kiln.cli", "fit", "cfg.yaml", "seed=1"], "max_restarts": 3}
    assert cli.main(["fit", "cfg.yaml", "--max-restarts", "1"]) == 0  # one process, restarted: the launcher too
    assert seen["nproc"] == 1 and seen["max_restarts"] == 1


def test_a_negative_max_restarts_is_refused_in_one_line(capsys):
    assert cli.main(["fit", "cfg.yaml", "--nproc", "2", "--max-restarts", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "kiln: error: --max-restarts must be >= 0, got -1."


def test_the_report_names_the_last_attempts_failure(tmp_path, capsys):
    """With restarts, an earlier attempt's report stays in the folder; the job failed in the last one."""

    def write(rank, attempt, error):
        (tmp_path / f"rank_{rank}.json").write_text(
            json.dumps(
                {"rank": rank, "time": 1.0 + attempt, "error": error, "detail": "", "exitcode": 1, "attempt": attempt}
            )
        )

    write(0, 0, "ValueError: attempt 0")  # rank 0 failed first time round, was restarted, and did not fail again
    write(1, 2, "ValueError: attempt 2")
    failures = {0: SimpleNamespace(exitcode=-signal.SIGTERM), 1: SimpleNamespace(exitcode=1)}
    assert local._report(SimpleNamespace(failures=failures), str(tmp_path), attempt=2) == 1
    assert "rank 1 failed first (exit code 1): ValueError: attempt 2" in capsys.readouterr().err


def test_the_report_names_the_failing_rank_not_a_peer_it_stopped_earlier(tmp_path, capsys):
    """A peer stopped by the failing rank's abort (RankFailed) may report before that rank: not a cause."""
    for rank, at, error in (
        (0, 1.0, "error: RankFailed: rank 1 failed with ValueError: x; ..."),
        (1, 2.0, "error: ValueError: x"),
    ):
        report = {"rank": rank, "time": at, "error": error, "detail": "", "exitcode": 2, "attempt": 0}
        (tmp_path / f"rank_{rank}.json").write_text(json.dumps(report))
    failures = {0: SimpleNamespace(exitcode=2), 1: SimpleNamespace(exitcode=2)}
    assert local._report(SimpleNamespace(failures=failures), str(tmp_path)) == 2
    assert "kiln: rank 1 failed first (exit code 2): error: ValueError: x" in capsys.readouterr().err


def test_a_workers_report_carries_its_attempt(tmp_path, monkeypatch):
    from kiln.launch import worker

    monkeypatch.setenv(local.REPORT_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "4")  # a requeued SLURM job around the launcher: not the agent's attempt
    worker._write_report("ValueError: x", "", 1)
    assert json.loads((tmp_path / "rank_1.json").read_text())["attempt"] == 2


def test_a_restarted_attempt_meets_in_its_own_namespace_of_the_agents_store():
    """torch keeps the agent's store across restarts without a prefix per attempt: the last attempt's
    gloo addresses would be read by the next one. From the first restart on, kiln meets under
    `kiln/attempt_<n>/`; attempt 0, and stores that are not the agent's, keep torch's env://."""
    from datetime import timedelta

    import torch.distributed as dist

    from kiln.launch.environment import attempt_store

    server = local._loopback_store()
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "WORLD_SIZE": "2",
        "RANK": "0",
    }
    store = attempt_store(timedelta(seconds=30), env)
    assert isinstance(store, dist.PrefixStore)
    store.set("rank_0", "fresh")
    assert server.check(["kiln/attempt_2/rank_0"]) and not server.check(["rank_0"])
    assert server.get("kiln/attempt_2/rank_0") == b"fresh"
    assert attempt_store(timedelta(seconds=30), {**env, "TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert attempt_store(timedelta(seconds=30), {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    # a group made again in one process (a second Trainer after teardown) meets apart from the first one
    again = attempt_store(timedelta(seconds=30), {**env, "TORCHELASTIC_RESTART_COUNT": "0"}, creation=1)
    again.set("rank_0", "second")
    assert server.get("kiln/attempt_0/group_1/rank_0") == b"second"
    attempt_store(timedelta(seconds=30), env, creation=2).set("rank_0", "third")
    assert server.get("kiln/attempt_2/group_2/rank_0") == b"third"
    assert attempt_store(timedelta(seconds=30), {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}, creation=1) is None


@pytest.mark.parametrize(
    "change,warned",
    [
        ({}, True),  # 2 nodes of 2, --max-restarts 3, the agents' shared store: rank 0 warns
        ({"RANK": "1"}, False),  # once per job
        ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        ({"TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # nothing restarts
        ({"LOCAL_WORLD_SIZE": "4"}, False),  # one node
    ],
)
def test_restarts_across_nodes_on_the_shared_store_are_warned_about_up_front(caplog, change, warned):
    from datetime import timedelta

    from kiln.launch.environment import attempt_store

    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "RANK": "0",
        **change,
    }
    with caplog.at_level("WARNING", logger="kiln"):
        assert attempt_store(timedelta(seconds=5), env) is None  # attempt 0: env:// as it is
    assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text) is warned
    assert ("--max-restarts 3" in caplog.text) is warned
