"""`kiln fit --ray N` / `launcher: {name: ray}` without starting Ray: the cluster kind that reads Ray
Train's context (and wins over the torchrun / accelerate variables Ray exports), what the CLI hands
the launcher, the launcher settings, and the one sentence for each bad input or a missing Ray."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from kiln import cli
from kiln.cli import dispatch, train_loop_per_worker
from kiln.config.load import load_config
from kiln.launch import ray as ray_launch
from kiln.launch.environment import KINDS, detect
from kiln.launch.environment import ray as ray_env
from kiln.utils.errors import KilnError

REPO = Path(__file__).resolve().parents[2]


class FakeContext:
    def get_world_size(self):
        return 4

    def get_world_rank(self):
        return 3

    def get_local_rank(self):
        return 1

    def get_local_world_size(self):
        return 2

    def get_node_rank(self):
        return 1


RAY_VARS = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1234",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_TORCH_DEVICE": "cpu",
}


def test_the_ray_kind_reads_rays_context_before_torchrun_and_accelerate(monkeypatch):
    assert KINDS.index(ray_env.RayTrain) == 0
    monkeypatch.setattr(ray_env, "train_context", lambda: FakeContext())
    env = detect(RAY_VARS)
    assert (env.source, env.world_size, env.rank, env.local_rank, env.local_world_size) == ("ray", 4, 3, 1, 2)
    assert (env.node_rank, env.num_nodes, env.rendezvous, env.launched) == (1, 2, True, True)
    assert detect({"RANK": "0", "WORLD_SIZE": "2"}).source == "ray"
    assert not detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}).rendezvous
    assert detect({}).source == "none"  # a Ray Train worker is one that has Ray's variables too


def test_outside_a_ray_train_worker_the_same_variables_belong_to_the_other_kinds(monkeypatch):
    assert ray_env.train_context() is None  # this process is no Ray Train worker
    assert detect(RAY_VARS).source == "accelerate"
    monkeypatch.setitem(
        sys.modules, "ray.train", SimpleNamespace(get_context=lambda: (_ for _ in ()).throw(RuntimeError()))
    )
    assert ray_env.train_context() is None  # Ray imported, but outside a Train worker (the driver, a Tune trial)
    monkeypatch.setitem(sys.modules, "ray.train", SimpleNamespace(get_context=FakeContext))
    assert isinstance(ray_env.train_context(), FakeContext)


def test_importing_kiln_and_its_cli_does_not_import_ray():
    code = (
        "import sys, kiln, kiln.cli, kiln.launch.ray, kiln.launch.environment, kiln.engine.hp_search; "
        "from kiln.launch.environment import detect; detect(); assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def write(path: Path, **extra) -> str:
    OmegaConf.save(OmegaConf.create({"output_dir": "out", "seed": 1, **extra}), path)
    return str(path)


@pytest.fixture
def launched(monkeypatch):
    seen: dict = {}

    def fake(argv, launch, train_loop, cwd=None):
        assert train_loop is train_loop_per_worker  # the CLI hands Ray its own per-worker function
        seen.update(argv=argv, launch=launch)
        return SimpleNamespace(error=None, checkpoint=SimpleNamespace(path="/ray/checkpoint-6"))

    monkeypatch.setattr(ray_launch, "launch_ray", fake)
    return seen


def test_fit_ray_n_hands_the_config_and_overrides_to_the_launcher(tmp_path, monkeypatch, launched, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = write(tmp_path / "c.yaml", launcher={"max_failures": 3, "resources_per_worker": {"CPU": 2}})
    assert cli.main(["fit", "c.yaml", "--ray", "2", "seed=3"]) == 0
    assert launched["argv"] == [
        cfg,
        "seed=3",
        f"output_dir={tmp_path / 'out'}",
    ]  # absolute: Ray's workers run elsewhere
    launch = launched["launch"]
    assert (launch.num_workers, launch.max_failures, launch.resources_per_worker) == (2, 3, {"CPU": 2})
    assert (launch.storage_path, launch.name, launch.address) == (str(tmp_path / "out" / "ray_results"), "out", None)
    assert "Ray's last checkpoint: /ray/checkpoint-6" in capsys.readouterr().out
    assert cli.main(["fit", "c.yaml", "--ray", "2", "--max-restarts", "1"]) == 0
    assert launched["launch"].max_failures == 1  # --max-restarts is Ray's max_failures


def test_the_config_key_alone_starts_ray(tmp_path, monkeypatch, launched):
    monkeypatch.chdir(tmp_path)
    write(
        tmp_path / "c.yaml",
        launcher={
            "name": "ray",
            "num_workers": 3,
            "address": "auto",
            "num_to_keep": 2,
            "checkpoint_score_attribute": "eval_loss",
            "storage_path": "store",
        },
        run_name="r",
    )
    assert cli.main(["fit", "c.yaml"]) == 0
    launch = launched["launch"]
    assert (launch.num_workers, launch.address, launch.num_to_keep, launch.checkpoint_score_attribute) == (
        3,
        "auto",
        2,
        "eval_loss",
    )
    assert (launch.storage_path, launch.name, launch.checkpoint_score_order) == (str(tmp_path / "store"), "r", "min")
    launched.clear()
    assert (
        cli.main(["fit", "c.yaml", "launcher.name=null", "--nproc", "0"]) == 2
    )  # the override turns Ray off: --nproc's own check
    assert launched == {}


def test_inside_a_ray_worker_the_cli_trains_instead_of_launching_again(tmp_path, monkeypatch, launched):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "c.yaml", launcher={"name": "ray"})
    monkeypatch.setattr(ray_env, "train_context", lambda: FakeContext())
    for key, value in RAY_VARS.items():
        monkeypatch.setenv(key, value)
    assert ray_launch.fit_with_ray("fit", "c.yaml", [], None, False, 0, train_loop=train_loop_per_worker) is None
    assert ray_launch.fit_with_ray("fit", "c.yaml", [], 2, False, 0, train_loop=train_loop_per_worker) is None
    assert launched == {}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["fit", "c.yaml", "--ray", "0"], "Ray needs at least one worker: num_workers (--ray) is 0."),
        (["fit", "c.yaml", "--ray", "2", "--nproc", "2"], "Ray starts the workers: drop --nproc / --accelerate-config"),
        (
            ["fit", "c.yaml", "--ray", "2", "launcher.max_failures=-1"],
            "launcher.max_failures (--max-restarts) must be >= 0, got -1.",
        ),
        (["fit", "c.yaml", "launcher.name=slurm"], "launcher.name 'slurm' is not a launcher kiln starts"),
        (["fit", "c.yaml", "--ray", "2", "launcher.checkpoint_score_order=best"], "must be min or max, got 'best'."),
        (
            ["fit", "c.yaml", "--ray", "2", "launcher.resources_per_worker={CPU: many}"],
            "launcher.resources_per_worker takes amounts",
        ),
        (
            ["evaluate", "c.yaml", "--ray", "2"],
            "--ray starts training workers; kiln evaluate runs in this process (drop --ray).",
        ),
    ],
)
def test_bad_ray_settings_are_one_sentence(tmp_path, monkeypatch, launched, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "c.yaml")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kiln: error: ") and message in err and len(err.splitlines()) == 1, err
    assert launched == {}


def test_a_missing_ray_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "c.yaml")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert cli.main(["fit", "c.yaml", "--ray", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kiln: error: kiln fit --ray needs Ray Train, which is not installed: pip install 'kiln[ray]'"
    )
    with pytest.raises(
        KilnError, match=r"hyperparameter_search\(backend='ray'\) needs Ray Train.*pip install 'kiln\[ray\]'"
    ):
        ray_launch.require_ray("hyperparameter_search(backend='ray')")


def test_a_failed_ray_run_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "c.yaml")

    def failing(argv, launch, train_loop, cwd=None):
        raise RuntimeError("Training failed due to worker errors:\n  traceback ...")

    monkeypatch.setattr(ray_launch, "launch_ray", failing)
    assert cli.main(["fit", "c.yaml", "--ray", "2"]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "kiln: error: the Ray Train run failed: RuntimeError: Training failed due to worker errors:"
    )
    monkeypatch.setattr(
        ray_launch, "launch_ray", lambda argv, launch, train_loop, cwd=None: SimpleNamespace(error=ValueError("x"))
    )
    assert cli.main(["fit", "c.yaml", "--ray", "2"]) == 1
    assert capsys.readouterr().err.strip() == "kiln: error: the Ray Train run failed: ValueError: x"


def test_launch_settings_from_the_config():
    cfg = load_config({"output_dir": "o", "launcher": {"num_workers": 2, "max_failures": 2}})
    launch = ray_launch.RayLaunch.from_config(cfg)
    assert (launch.num_workers, launch.max_failures, launch.storage_path) == (2, 2, os.path.abspath("o/ray_results"))
    assert ray_launch.RayLaunch.from_config(cfg, num_workers=5, max_failures=0).num_workers == 5
    assert ray_launch.RayLaunch.from_config(cfg, max_failures=0).max_failures == 2  # --max-restarts 0: the key's value


def test_a_local_ray_instance_is_sized_for_the_workers_and_an_address_is_joined(monkeypatch):
    calls: list = []
    fake = SimpleNamespace(
        is_initialized=lambda: bool(calls and calls[-1] == "running"), init=lambda **kw: calls.append(kw)
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert ray_launch._start(ray_launch.RayLaunch(num_workers=3, resources_per_worker={"CPU": 1.5})) is True
    assert calls[-1] == {"num_cpus": 5, "include_dashboard": False}  # 4.5 CPUs asked for, rounded up; above the cores
    assert ray_launch._start(ray_launch.RayLaunch(num_workers=1)) is True
    assert calls[-1] == {"num_cpus": 2, "include_dashboard": False}  # at least the machine's cores
    assert ray_launch._start(ray_launch.RayLaunch(num_workers=3)) is True
    assert calls[-1] == {"num_cpus": 3, "include_dashboard": False}  # one CPU per worker unless resources say
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # cores unknown: what the workers ask for
    assert ray_launch._start(ray_launch.RayLaunch(num_workers=1)) is True
    assert calls[-1] == {"num_cpus": 1, "include_dashboard": False}
    assert ray_launch._start(ray_launch.RayLaunch(num_workers=2, address="auto")) is True
    assert calls[-1] == {"address": "auto"}
    calls.append("running")  # a Ray the caller started is used as it is, and left running
    assert ray_launch._start(ray_launch.RayLaunch(num_workers=2)) is False and calls[-1] == "running"


def test_the_report_callback_hands_rank_zeros_sealed_checkpoint_and_the_steps_metrics(tmp_path, monkeypatch):
    """Every rank reports (Ray's report is a barrier); only global rank 0 hands over the folder, and only
    a complete one; the metrics are what was logged at that step."""
    import json

    from kiln.engine.callbacks.ray_report import RayReportCallback
    from kiln.engine.callbacks.state import TrainerControl, TrainerState

    callback = RayReportCallback()  # checks that Ray is installed: before the stand-in replaces it
    reports: list = []
    train = SimpleNamespace(
        Checkpoint=SimpleNamespace(from_directory=lambda path: ("checkpoint", path)),
        report=lambda metrics, **kw: reports.append((metrics, kw)),
    )
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(train=train))
    monkeypatch.setitem(sys.modules, "ray.train", train)
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"1234")
    config = OmegaConf.create({"output_dir": str(tmp_path)})
    history = [{"loss": 0.9, "step": 2}, {"loss": 0.5, "learning_rate": 0.01, "step": 4}, {"eval_loss": 0.4, "step": 4}]
    for zero in (True, False):
        state = TrainerState(global_step=4, epoch=1.5, log_history=history, is_world_process_zero=zero)
        callback.on_save(config, state, TrainerControl())
    from kiln.engine.checkpoint.integrity import ALGORITHM, VERSION, file_digest

    (folder / "COMPLETE").write_text(
        json.dumps(
            {
                "files": {"model.safetensors": 4},
                "step": 4,
                "version": VERSION,
                ALGORITHM: {"model.safetensors": file_digest(str(folder / "model.safetensors"))},
            }
        )
    )
    callback.on_save(config, TrainerState(global_step=4, epoch=1.5, log_history=history), TrainerControl())
    metrics = {"loss": 0.5, "learning_rate": 0.01, "eval_loss": 0.4, "step": 4, "epoch": 1.5}
    unsealed = {"checkpoint": None, "checkpoint_dir_name": None, "delete_local_checkpoint_after_upload": False}
    assert reports == [
        (metrics, unsealed),
        (metrics, unsealed),  # no marker yet: not a checkpoint to hand over
        (
            metrics,
            {
                "checkpoint": ("checkpoint", str(folder)),
                "checkpoint_dir_name": "checkpoint-4",
                "delete_local_checkpoint_after_upload": False,
            },
        ),
    ]
    assert callback.reported == [4, 4, 4]


def test_a_ray_worker_runs_the_fit_it_is_handed_and_resumes_from_rays_checkpoint(tmp_path, monkeypatch):
    """launch/ sits below the CLI: the per-worker body runs the `fit` the CLI hands it, never the CLI by name."""
    import contextlib
    import pickle

    calls: list = []
    checkpoint = None

    class FakeCheckpoint:
        @contextlib.contextmanager
        def as_directory(self):
            yield "/ray/ckpt-3"

    train = SimpleNamespace(get_checkpoint=lambda: checkpoint)
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(train=train))
    monkeypatch.setitem(sys.modules, "ray.train", train)
    monkeypatch.chdir(tmp_path)
    ray_launch.run_worker({"argv": ["c.yaml", "seed=3"], "cwd": str(tmp_path)}, lambda argv: calls.append(argv) or 0)
    checkpoint = FakeCheckpoint()
    ray_launch.run_worker({"argv": ["c.yaml"]}, lambda argv: calls.append(argv) or 0)
    assert calls == [["c.yaml", "seed=3"], ["c.yaml", "resume_from_checkpoint=/ray/ckpt-3"]]
    with pytest.raises(RuntimeError, match="kiln fit exited with code 2 in this Ray worker"):
        ray_launch.run_worker({"argv": ["c.yaml"]}, lambda argv: 2)
    assert pickle.loads(pickle.dumps(train_loop_per_worker)) is train_loop_per_worker  # Ray ships it by reference
    monkeypatch.setattr(dispatch, "main", lambda argv: calls.append(argv) or 0)
    train_loop_per_worker({"argv": ["d.yaml"]})
    assert calls[-1] == ["fit", "d.yaml", "resume_from_checkpoint=/ray/ckpt-3"]
