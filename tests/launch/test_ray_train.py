"""kiln's fit in Ray Train workers (issue 32 item 1), on one local Ray instance for the module
(`ray.init(num_cpus=2)`): `kiln fit --ray 2` trains with DDP on Ray's own process group to the
weights of one process with the double batch; each kiln checkpoint is reported to Ray (CheckpointConfig
and Result.checkpoint work on them); and a worker that dies mid-run makes Ray restart the group,
which resumes from the checkpoint Ray hands back and ends where the uninterrupted run ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from kiln import cli
from kiln.engine.checkpoint.files import is_complete

ray = pytest.importorskip("ray", reason="pip install 'kiln[ray]'")

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
MAX_STEPS, SAVE_STEPS = 6, 2


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance for the module; the workers import the tests' task code from the repository."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def write_config(path: Path, output_dir: Path, **data_args) -> str:
    cfg = {
        "output_dir": str(output_dir), "seed": 5, "learning_rate": 1e-2, "max_steps": MAX_STEPS,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "save_steps": SAVE_STEPS, "logging_steps": 1,
        "disable_tqdm": True, "report_to": "none", "strategy": {"name": "auto", "device": "cpu", "timeout": 60},
        "task": {"model": "tests.distributed.toy:cli_model", "model_args": {"dropout": 0.0},
                 "data": "tests.launch.ray_toy:data", "data_args": data_args},
    }
    OmegaConf.save(OmegaConf.create(cfg), path)
    return str(path)


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model.safetensors"))


def losses(output_dir: Path) -> list[float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


@pytest.fixture(scope="module")
def ray_ddp(local_ray, tmp_path_factory):
    """`kiln fit --ray 2` on the module's Ray instance: (output_dir, what the launcher printed)."""
    root = tmp_path_factory.mktemp("ray_ddp")
    folder = root / "marks"
    folder.mkdir()
    out = root / "run"
    code = cli.main(["fit", write_config(root / "c.yaml", out, folder=str(folder)), "--ray", "2"])
    assert code == 0
    return out, (folder / "starts").read_text().split()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process (no Ray) with the double batch."""
    root = tmp_path_factory.mktemp("single")
    assert cli.main(["fit", write_config(root / "c.yaml", root / "run"), "per_device_train_batch_size=8",
                     "strategy.name=single"]) == 0
    return root / "run"


def assert_same_run(out: Path, reference: Path) -> None:
    got, want = weights(out), weights(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    assert losses(out) == pytest.approx(losses(reference), abs=1e-6)


def test_two_ray_workers_train_like_one_process_with_the_double_batch(ray_ddp, single):
    out, starts = ray_ddp
    assert starts == ["ray:2:0"]  # the cluster kind read Ray's topology: 2 ranks, started once
    assert_same_run(out, single)


@pytest.mark.heavy
def test_fsdp_in_two_ray_workers_trains_like_one_process(local_ray, single, tmp_path):
    folder, out = tmp_path / "marks", tmp_path / "run"
    folder.mkdir()
    assert cli.main(["fit", write_config(tmp_path / "c.yaml", out, folder=str(folder)), "--ray", "2",
                     "strategy.name=fsdp"]) == 0
    assert (folder / "starts").read_text().split() == ["ray:2:0"]
    assert_same_run(out, single)


def test_every_checkpoint_is_copied_into_rays_storage_with_its_seal(ray_ddp):
    out, _ = ray_ddp
    runs = [p for p in (out / "ray_results").iterdir() if p.is_dir()]  # storage_path's default; the run: output_dir's name
    assert [r.name for r in runs] == ["run"]
    copies = sorted(p for p in runs[0].iterdir() if p.name.startswith("checkpoint-"))
    assert [p.name for p in copies] == [f"checkpoint-{s}" for s in (2, 4, 6)]
    for copy in copies:  # Ray's copy keeps kiln's seal: the COMPLETE marker matches every file
        assert is_complete(str(copy))


@pytest.mark.heavy  # two worker groups one after the other: over the Ray tests' CI budget on 2 cores
def test_a_worker_that_dies_is_restarted_by_ray_and_resumes_exactly(ray_ddp, tmp_path):
    from kiln.config.load import load_config
    from kiln.launch.ray import RayLaunch, launch_ray

    straight, _ = ray_ddp
    folder, out = tmp_path / "marks", tmp_path / "run"
    folder.mkdir()
    cfg_path = write_config(tmp_path / "c.yaml", out, folder=str(folder), die_rank=1, die_step=5)
    launch = RayLaunch.from_config(load_config(cfg_path), num_workers=2, max_failures=1)
    launch = RayLaunch(**{**launch.__dict__, "num_to_keep": 2, "checkpoint_score_attribute": "loss"})
    result = launch_ray([cfg_path], launch)
    assert (folder / "killed").read_text() == "1:5"
    assert (folder / "starts").read_text().split() == ["ray:2:0", "ray:2:4"]  # resumed from Ray's checkpoint-4
    assert result.error is None and os.path.basename(result.checkpoint.path) == "checkpoint-6"
    assert result.metrics["step"] == MAX_STEPS and "loss" in result.metrics
    # CheckpointConfig(num_to_keep=2, score: the reported loss) on kiln's checkpoints: the two lowest losses
    # stay in Ray's storage, and the latest (Ray never deletes it)
    loss_at = {h["step"]: h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h}
    best_two = sorted((2, 4, 6), key=lambda step: loss_at[step])[:2]
    kept = {int(p.name.split("-")[1]) for p in Path(result.path).iterdir() if p.name.startswith("checkpoint-")}
    assert kept == {*best_two, 6}
    for name, tensor in weights(straight).items():
        assert torch.equal(weights(out)[name], tensor), name
    assert losses(out) == losses(straight)
