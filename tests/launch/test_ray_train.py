"""kiln's fit in Ray Train workers (issue 32 item 1), on the package's local Ray instance
(`ray.init(num_cpus=2)`, tests/launch/conftest.py). One DDP run in 2 Ray workers covers the DDP
parity, the checkpoints handed to Ray and the restart: Ray's process group trains to the weights of
`kiln fit` on 2 torchrun-style processes (bit for bit) and of one process with the double batch; rank 1 dies mid-run,
Ray restarts the group, which resumes from the checkpoint Ray hands back and ends bit-identical to
the uninterrupted 2-process run; Ray keeps kiln's checkpoints by its CheckpointConfig, each copy
sealed. FSDP runs in 2 Ray workers too (heavy), to the weights of one process.

(A Ray Train run costs seconds of process starts on 2 cores: the restart shares its run with the
DDP parity and with test_ray_output_once.py (`ray_restarted_run`, tests/launch/conftest.py), and the
uninterrupted reference is a 2-process world forked by tests/world.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln import cli
from kiln.engine.checkpoint.files import is_complete
from tests.distributed.conftest import HERE as DISTRIBUTED
from tests.installed import requires
from tests.launch.ray_toy import DIE_STEP, MAX_STEPS, SAVE_STEPS, write_config
from tests.world import run_world

pytestmark = [pytest.mark.distributed, requires("ray", "pip install 'kiln[ray]'")]


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model.safetensors"))


def losses(output_dir: Path) -> list[float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


@pytest.fixture(scope="module")
def nproc(tmp_path_factory):
    """The uninterrupted reference: `kiln fit` on a 2-process world as torchrun starts it (tests/world.py:
    forked ranks; what is compared is Ray's process group, not a launcher), same config."""
    root = tmp_path_factory.mktemp("nproc")
    run_world(DISTRIBUTED / "worker_cli_runs.py", write_config(root / "c.yaml", root / "run"), timeout=300)
    return root / "run"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process (no Ray) with the double batch."""
    root = tmp_path_factory.mktemp("single")
    assert (
        cli.main(
            [
                "fit",
                write_config(root / "c.yaml", root / "run"),
                "per_device_train_batch_size=8",
                "strategy.name=single",
            ]
        )
        == 0
    )
    return root / "run"


def assert_same_run(out: Path, reference: Path) -> None:
    got, want = weights(out), weights(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    assert losses(out) == pytest.approx(losses(reference), abs=1e-6)


def test_two_ray_workers_train_like_nproc_2_and_like_one_process_with_the_double_batch(
    ray_restarted_run, nproc, single
):
    out, folder, _ = ray_restarted_run
    assert (folder / "starts").read_text().split()[0] == "ray:2:0"  # the cluster kind read Ray's topology: 2 ranks
    for name, tensor in weights(nproc).items():  # Ray's process group, bit for bit (through the restart)
        assert torch.equal(weights(out)[name], tensor), name
    assert_same_run(out, single)


def test_a_worker_that_dies_is_restarted_by_ray_and_resumes_exactly(ray_restarted_run, nproc):
    out, folder, result = ray_restarted_run
    assert (folder / "killed").read_text() == f"1:{DIE_STEP}"
    assert (folder / "starts").read_text().split() == ["ray:2:0", "ray:2:4"]  # resumed from Ray's checkpoint-4
    assert result.error is None and os.path.basename(result.checkpoint.path) == f"checkpoint-{MAX_STEPS}"
    assert result.metrics["step"] == MAX_STEPS and "loss" in result.metrics
    # the resumed run ends as the uninterrupted one: the same weights and losses, bit for bit
    for name, tensor in weights(nproc).items():
        assert torch.equal(weights(out)[name], tensor), name
    assert losses(out) == losses(nproc)


def test_ray_keeps_kilns_checkpoints_by_its_checkpoint_config_each_with_its_seal(ray_restarted_run):
    out, _, result = ray_restarted_run
    runs = [
        p for p in (out / "ray_results").iterdir() if p.is_dir()
    ]  # storage_path's default; the run: output_dir's name
    assert [r.name for r in runs] == ["run"] and Path(result.path) == runs[0]
    # CheckpointConfig(num_to_keep=2, score: the reported loss) on kiln's checkpoints: the two lowest losses
    # stay in Ray's storage, and the latest (Ray never deletes it)
    loss_at = {
        h["step"]: h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h
    }
    best_two = sorted(range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS), key=lambda step: loss_at[step])[:2]
    copies = sorted(p for p in runs[0].iterdir() if p.name.startswith("checkpoint-"))
    assert {int(p.name.split("-")[1]) for p in copies} == {*best_two, MAX_STEPS}
    for copy in copies:  # Ray's copy keeps kiln's seal: the COMPLETE marker matches every file
        assert is_complete(str(copy))


@pytest.fixture(scope="module")
def ray_fsdp_run(local_ray, tmp_path_factory):
    """`kiln fit --ray 2 strategy.name=fsdp`: (output_dir, marks folder)."""
    root = tmp_path_factory.mktemp("ray_fsdp")
    folder, out = root / "marks", root / "run"
    folder.mkdir()
    config = write_config(root / "c.yaml", out, folder=str(folder))
    assert cli.main(["fit", config, "--ray", "2", "strategy.name=fsdp"]) == 0
    return out, folder


# CI time (~1.5 min): Ray's launch is the same for every strategy (the DDP tests above cover it), and FSDP's
# own tests cover FSDP under torchrun
@pytest.mark.heavy
def test_fsdp_in_two_ray_workers_trains_like_one_process(ray_fsdp_run, single):
    out, folder = ray_fsdp_run
    assert (folder / "starts").read_text().split() == ["ray:2:0"]
    assert_same_run(out, single)
