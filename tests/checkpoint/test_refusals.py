"""Checkpoints kiln must refuse, clearly: a different model, corrupt or truncated files, a malicious
pickle (nothing from it may run), a world-size change for a format that cannot reshard, an incomplete
checkpoint; and an output_dir that already holds checkpoints when not resuming."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from kiln.engine.checkpoint.files import MARKER, is_complete, latest_checkpoint
from kiln.engine.checkpoint.integrity import ALGORITHM, file_digest
from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
from kiln.strategies.single import SingleDeviceStrategy
from kiln.utils.errors import CheckpointError, KilnError, safe_torch_load
from tests.checkpoint.checkpoint_helpers import folders, train

CFG = {"max_steps": 4, "save_steps": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run with checkpoint-2 and checkpoint-4; tests copy it before damaging it."""
    out = str(tmp_path_factory.mktemp("ckpt") / "run")
    train(out, CFG)
    return out


@pytest.fixture
def out(run, tmp_path):
    import shutil

    copy = str(tmp_path / "run")
    shutil.copytree(run, copy)
    return copy


def remark(ckpt: str) -> None:
    """Rewrite the marker so its sizes match the (tampered) files: an attacker controls the folder."""
    path = os.path.join(ckpt, MARKER)
    meta = json.loads(Path(path).read_text())
    meta["files"] = {f: os.path.getsize(os.path.join(ckpt, f)) for f in meta["files"]}
    meta[ALGORITHM] = {f: file_digest(os.path.join(ckpt, f)) for f in meta["files"]}  # checksums too
    Path(path).write_text(json.dumps(meta))


# -- a different model ----------------------------------------------------------------------------
def test_mis_shaped_keys_are_named(out):
    with pytest.raises(CheckpointError) as err:
        train(out, CFG, resume=True, model_kw={"width": 8})
    msg = str(err.value)
    assert "does not fit this model" in msg and "mis-shaped keys" in msg
    assert "inp.weight (checkpoint (16, 4), model (8, 4))" in msg and "out.weight" in msg


def test_missing_and_unexpected_keys_are_named(out):
    from tests.checkpoint import checkpoint_helpers as h

    class Other(h.Net):
        def __init__(self):
            super().__init__()
            del self.out
            self.head = torch.nn.Linear(16, 1)

        def forward(self, x):
            return self.head(torch.relu(self.inp(x))).squeeze(-1)

    from kiln.engine.trainer import Trainer

    trainer = Trainer(Other(), h.config(out, **CFG), train_dataset=h.regression_data())
    with pytest.raises(CheckpointError) as err:
        trainer.fit(resume_from_checkpoint=True)
    msg = str(err.value)
    assert "missing keys: head.bias, head.weight" in msg and "unexpected keys: out.bias, out.weight" in msg


# -- corrupt files --------------------------------------------------------------------------------
def truncate(path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_truncated_file_makes_the_checkpoint_incomplete(out, name):
    ckpt = os.path.join(out, "checkpoint-4")
    truncate(os.path.join(ckpt, name))
    assert not is_complete(ckpt)
    with pytest.warns(UserWarning, match="Ignoring incomplete checkpoint .*checkpoint-4"):
        assert latest_checkpoint(out).endswith("checkpoint-2")  # resume=True falls back to the previous one
    with pytest.raises(CheckpointError, match="checkpoint-4 is incomplete or damaged"):
        train(out, CFG, resume=ckpt)


@pytest.mark.parametrize(
    "name, message",
    [
        ("model.safetensors", "model.safetensors is corrupt or truncated"),
        ("optimizer.pt", "optimizer.pt is corrupt, truncated or not a torch file"),
    ],
)
def test_corrupt_file_with_a_matching_marker_is_refused(out, name, message):
    """Damage the size check cannot see (a truncated file recorded as such, e.g. written by a broken
    tool): loading still refuses with the file's name."""
    ckpt = os.path.join(out, "checkpoint-4")
    truncate(os.path.join(ckpt, name))
    remark(ckpt)
    with pytest.raises(CheckpointError, match=message):
        train(out, CFG, resume=ckpt)


def test_garbled_safetensors_header_is_refused(out):
    ckpt = os.path.join(out, "checkpoint-4")
    path = os.path.join(ckpt, "model.safetensors")
    data = bytearray(Path(path).read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    Path(path).write_bytes(bytes(data))
    remark(ckpt)  # past the checksums too (test_integrity.py): the reader itself must refuse
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        train(out, CFG, resume=ckpt)


# -- malicious pickles ----------------------------------------------------------------------------
class Payload:
    """Unpickling this would create the marker file (a stand-in for any code an attacker runs)."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: str, marker: str, zipped: bool) -> None:
    payload = Payload()
    payload.marker = marker
    if zipped:
        torch.save({"state": payload, "param_groups": []}, path)  # a torch-format file holding the payload
    else:
        with open(path, "wb") as fh:
            pickle.dump({"state": payload}, fh)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("name", ["optimizer.pt", "rng_state_0.pth", "scheduler.pt", "loop_state_0.pt"])
@pytest.mark.parametrize("zipped", [True, False])
def test_malicious_pickle_is_refused_and_nothing_runs(out, tmp_path, name, zipped):
    ckpt = os.path.join(out, "checkpoint-4")
    marker = str(tmp_path / "PWNED")
    plant(os.path.join(ckpt, name), marker, zipped)
    remark(ckpt)  # the folder looks complete and valid
    assert is_complete(ckpt)
    with pytest.raises(CheckpointError) as err:
        train(out, CFG, resume=True)
    assert f"Refusing to load {os.path.join(ckpt, name)}" in str(err.value)
    assert "never executes code" in str(err.value)
    assert not os.path.exists(marker), "the payload ran"


def test_malicious_pytorch_model_bin_is_refused(tmp_path):
    out = str(tmp_path / "run")
    train(out, {**CFG, "save_safetensors": False})
    ckpt = os.path.join(out, "checkpoint-4")
    marker = str(tmp_path / "PWNED")
    plant(os.path.join(ckpt, "pytorch_model.bin"), marker, zipped=True)
    remark(ckpt)
    with pytest.raises(CheckpointError, match="Refusing to load"):
        train(out, {**CFG, "save_safetensors": False}, resume=ckpt)
    assert not os.path.exists(marker)


def test_safe_torch_load_never_suggests_weights_only_false(tmp_path):
    path = str(tmp_path / "evil.pt")
    plant(path, str(tmp_path / "PWNED"), zipped=True)
    with pytest.raises(CheckpointError) as err:
        safe_torch_load(path)
    assert "weights_only" not in str(err.value) and "GLOBAL" in str(err.value)


# -- world size and format ------------------------------------------------------------------------
class ShardedIO(FullStateCheckpointIO):
    format = "test-shards"
    reshardable = False  # like per-rank shards without a resharding loader


class ShardedStrategy(SingleDeviceStrategy):
    def checkpoint_io(self):
        return ShardedIO(self)


def test_world_size_change_is_refused_for_a_non_resharding_format(tmp_path):
    out = str(tmp_path / "run")
    train(out, CFG, strategy=ShardedStrategy)
    ckpt = os.path.join(out, "checkpoint-4")
    marker = os.path.join(ckpt, MARKER)
    meta = json.loads(Path(marker).read_text())
    meta["world_size"] = 4  # saved by four processes
    Path(marker).write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError, match="holds shards for 4 processes but this run has 1.*resume with 4 processes"
    ):
        train(out, CFG, resume=ckpt, strategy=ShardedStrategy)
    with pytest.raises(CheckpointError, match="'test-shards' checkpoint format, but this run uses 'full'"):
        train(out, CFG, resume=ckpt)


def test_world_size_change_for_the_full_format_warns(out):
    ckpt = os.path.join(out, "checkpoint-2")
    meta = json.loads(Path(os.path.join(ckpt, MARKER)).read_text())
    meta["world_size"] = meta["data_shards"] = 2  # two data-parallel processes
    Path(os.path.join(ckpt, MARKER)).write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="saved by 2 processes and this run has 1"):
        train(out, CFG, resume=ckpt)


def test_changed_batch_size_warns(out):
    with pytest.warns(UserWarning, match=r"data.per_device_train_batch_size 4 -> 2"):
        train(out, {**CFG, "max_steps": 6, "per_device_train_batch_size": 2}, resume=os.path.join(out, "checkpoint-2"))


# -- output_dir -----------------------------------------------------------------------------------
def test_output_dir_with_checkpoints_is_not_overwritten(out):
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in folders(out)}
    with pytest.raises(
        KilnError, match="already holds checkpoints .*resume_from_checkpoint=true.*overwrite_output_dir=true"
    ):
        train(out, CFG)
    assert {f: os.path.getmtime(os.path.join(out, f)) for f in folders(out)} == before
    trainer = train(out, {**CFG, "overwrite_output_dir": True})  # explicit: allowed
    assert trainer.state.global_step == 4


def test_resume_from_checkpoint_in_the_config(out):
    trainer = train(out, {**CFG, "max_steps": 6, "resume_from_checkpoint": "true"})
    assert trainer.state.log_history[0]["step"] <= 4  # history continued from the checkpoint
    assert trainer.state.global_step == 6


def test_resume_true_with_no_checkpoint_is_refused_and_if_exists_starts_fresh(tmp_path):
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):  # HF's ValueError
        train(str(tmp_path / "new"), CFG, resume=True)
    trainer = train(str(tmp_path / "new"), CFG, resume="if_exists")
    assert trainer.state.global_step == 4


def test_missing_checkpoint_path_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="Can.t find a valid checkpoint at .*nope \\(no such folder\\)"):
        train(str(tmp_path / "new"), CFG, resume=str(tmp_path / "nope"))
