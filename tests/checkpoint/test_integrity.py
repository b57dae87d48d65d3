"""Damage that keeps a file's size (flipped bytes, an edited step) is caught by the checksums in the
COMPLETE marker: `resume_from_checkpoint=true` falls back to the previous intact checkpoint with one
warning (and ends exactly where an uninterrupted run does), an explicit path is refused; a full disk
says so in one sentence and leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from kiln.engine.checkpoint.files import MARKER, is_complete, latest_checkpoint, why_damaged
from kiln.engine.checkpoint.integrity import ALGORITHM, file_digest
from kiln.engine.checkpoint.write_errors import disk_full
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import train, weights

CFG = {"max_steps": 6, "save_steps": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """checkpoint-2/-4/-6 of a run, and that run's final weights (what an exact resume must reach)."""
    out = str(tmp_path_factory.mktemp("integrity") / "run")
    return out, weights(train(out, CFG))


@pytest.fixture
def out(run, tmp_path):
    copy = str(tmp_path / "run")
    shutil.copytree(run[0], copy)
    shutil.rmtree(os.path.join(copy, "checkpoint-6"))  # resume has work left: steps 5-6
    return copy


def flip(path: str, count: int = 64) -> None:
    """Invert `count` bytes in the middle of the file: same size, different content."""
    with open(path, "r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size // 2 - count // 2))
        data = fh.read(count)
        fh.seek(max(0, size // 2 - count // 2))
        fh.write(bytes(b ^ 0xFF for b in data))


def test_every_file_has_a_checksum_in_the_marker(out):
    ckpt = os.path.join(out, "checkpoint-4")
    meta = json.load(open(os.path.join(ckpt, MARKER)))
    assert set(meta[ALGORITHM]) == set(meta["files"]) and "model.safetensors" in meta[ALGORITHM]
    assert all(file_digest(os.path.join(ckpt, f)) == d for f, d in meta[ALGORITHM].items())
    assert why_damaged(ckpt) is None


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng_state_0.pth", "scheduler.pt"])
def test_flipped_bytes_fall_back_to_the_previous_intact_checkpoint(run, out, name):
    ckpt = os.path.join(out, "checkpoint-4")
    flip(os.path.join(ckpt, name))
    assert is_complete(ckpt)  # the sizes still match: only the checksum can tell
    with pytest.warns(
        UserWarning,
        match=rf"Ignoring damaged checkpoint .*checkpoint-4: {name} does not match the "
        r"checksum.*previous intact checkpoint",
    ):
        trainer = train(out, CFG, resume=True)
    final = weights(trainer)
    assert all(torch.equal(final[k], v) for k, v in run[1].items())  # resumed from checkpoint-2, exactly


def test_an_explicit_damaged_checkpoint_is_refused(out):
    ckpt = os.path.join(out, "checkpoint-4")
    flip(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-4 is damaged: model.safetensors does not match the checksum.*"
        r"resume_from_checkpoint=true to pick the newest intact one",
    ):
        train(out, CFG, resume=ckpt)


def test_an_edited_global_step_is_caught(out):
    ckpt = os.path.join(out, "checkpoint-4")
    state_file = os.path.join(ckpt, "trainer_state.json")
    text = open(state_file).read()
    assert '"global_step": 4' in text
    open(state_file, "w").write(text.replace('"global_step": 4', '"global_step": 3'))
    assert is_complete(ckpt)
    assert "does not match the checksum" in (why_damaged(ckpt) or "")
    # also when whoever edited it rewrote the checksums: the step disagrees with the marker's
    meta = json.load(open(os.path.join(ckpt, MARKER)))
    meta[ALGORITHM]["trainer_state.json"] = file_digest(state_file)
    json.dump(meta, open(os.path.join(ckpt, MARKER), "w"))
    assert "trainer_state.json says global_step 3 but the checkpoint was written at step 4" in (why_damaged(ckpt) or "")
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint"):
        assert latest_checkpoint(out, verify=True).endswith("checkpoint-2")


def test_a_renamed_folder_is_caught(out):
    os.rename(os.path.join(out, "checkpoint-4"), os.path.join(out, "checkpoint-5"))
    assert "folder name says step 5" in (why_damaged(os.path.join(out, "checkpoint-5")) or "")


def test_checkpoints_that_predate_checksums_are_judged_by_size_with_a_warning(out):
    """Checkpoints of kiln versions before checksums have neither digests nor a marker version: still
    resumable, judged by size, and said so."""
    ckpt = os.path.join(out, "checkpoint-4")
    meta = json.load(open(os.path.join(ckpt, MARKER)))
    del meta[ALGORITHM], meta["version"]
    json.dump(meta, open(os.path.join(ckpt, MARKER), "w"))
    with pytest.warns(UserWarning, match=r"checkpoint-4 predates checksums .*judged by its file sizes only"):
        assert latest_checkpoint(out, verify=True).endswith("checkpoint-4")


# -- a full disk ------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(small_disk):
    from kiln.engine.callbacks.base import Callback

    out = os.path.join(small_disk, "run")

    class FillDisk(Callback):
        def on_save(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 2:  # leave a few KB: the next checkpoint cannot fit
                free = shutil.disk_usage(small_disk).free
                with open(os.path.join(small_disk, "filler"), "wb") as fh:
                    fh.write(b"\0" * max(0, free - 2048))

    with pytest.raises(CheckpointError) as err:
        train(out, {"max_steps": 4, "save_steps": 2}, callbacks=[FillDisk()])
    message = str(err.value)
    assert message.startswith("No space left on device (ENOSPC) while writing checkpoint-4 in ")
    assert "the previous checkpoint checkpoint-2 is intact" in message and "resume_from_checkpoint=true" in message
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == ["checkpoint-2"]  # no half-written debris
    assert why_damaged(os.path.join(out, "checkpoint-2")) is None and is_complete(os.path.join(out, "checkpoint-2"))


def test_torch_saves_bare_error_on_a_full_disk_is_recognised(small_disk):
    with open(os.path.join(small_disk, "filler"), "wb") as fh:
        fh.write(b"\0" * (shutil.disk_usage(small_disk).free - 1024))
    try:
        torch.save({"w": torch.zeros(100_000)}, os.path.join(small_disk, "x.pt"))
    except RuntimeError as err:  # "[enforce fail at inline_container.cc] unexpected pos ...": nothing about space
        assert disk_full(err, small_disk)
    else:
        pytest.fail("torch.save fit on a full disk")
    assert not disk_full(RuntimeError("unexpected pos 1 vs 2"), os.path.dirname(small_disk))


def test_evaluate_refuses_damaged_weights(out):
    from kiln.engine.checkpoint.weights import find_run_weights, given_weights

    ckpt = os.path.join(out, "checkpoint-4")
    assert given_weights(ckpt).step == 4
    flip(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"--weights .*checkpoint-4' is damaged: model.safetensors does not match"
    ):
        given_weights(ckpt)
    with pytest.raises(CheckpointError, match=r"the last checkpoint .*checkpoint-4' is damaged"):
        find_run_weights(out)


@pytest.mark.parametrize("size", [0, 1, (8 << 20) + 3, 3 * (8 << 20)])
def test_the_digest_covers_every_byte(tmp_path, size):
    """Hashed in chunks from a memory map: every chunk, the first and the last byte count."""
    import xxhash

    data = bytearray(os.urandom(size))
    path = tmp_path / "f"
    path.write_bytes(bytes(data))
    assert file_digest(str(path)) == xxhash.xxh3_64(bytes(data)).hexdigest()
    for where in {0, size // 2, size - 1} if size else set():
        changed = bytearray(data)
        changed[where] ^= 1
        path.write_bytes(bytes(changed))
        assert file_digest(str(path)) != xxhash.xxh3_64(bytes(data)).hexdigest()


def test_resume_with_only_damaged_checkpoints_refuses_true_and_starts_fresh_if_exists(tmp_path):
    from kiln.engine.checkpoint.resume import resolve_resume

    out = str(tmp_path / "run")
    train(out, {"max_steps": 2, "save_steps": 2})
    flip(os.path.join(out, "checkpoint-2", "model.safetensors"))
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint"):
        with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
            resolve_resume(True, out)
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint"):
        assert resolve_resume("if_exists", out) is None
