"""Probes that plant an attack on a checkpoint and expect refusal (issue 52, integrity items 1-3):
weights swapped for an index and shards holding other weights with COMPLETE untouched, bit rot inside a
digested shard, weights files added after sealing, a stripped digest table (downgrade), a kiln
checkpoint stripped of its marker passing for one HF's Trainer wrote, and an HF checkpoint whose
weights are truncated, incomplete or not finite."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.engine.checkpoint.files import MARKER, is_complete, latest_checkpoint, why_damaged
from kiln.engine.checkpoint.hf_folder import is_hf_checkpoint
from kiln.engine.checkpoint.integrity import ALGORITHM, file_digest
from kiln.engine.checkpoint.resume import ResumeError, resolve_resume
from kiln.strategies.weights_files import INDEX, save_sharded
from tests.checkpoint.checkpoint_helpers import train, weights
from tests.checkpoint.test_integrity import CFG, flip, out, run  # noqa: F401 - fixtures: checkpoint-2 and -4


def rot_tail(path: str) -> None:
    """Invert the last 8 bytes (tensor data, not the safetensors header)."""
    with open(path, "r+b") as fh:
        fh.seek(-8, os.SEEK_END)
        data = fh.read()
        fh.seek(-8, os.SEEK_END)
        fh.write(bytes(b ^ 0xFF for b in data))


def marker(ckpt: str) -> dict:
    return json.loads(open(os.path.join(ckpt, MARKER)).read())


def write_marker(ckpt: str, meta: dict) -> None:
    with open(os.path.join(ckpt, MARKER), "w") as fh:
        json.dump(meta, fh)


def refused_by_path_and_true(out: str, ckpt: str, reason: str) -> None:
    """A resume by path is refused naming `reason`; `true` passes over the checkpoint to checkpoint-2."""
    with pytest.raises(ResumeError, match=reason):
        resolve_resume(ckpt, out)
    with pytest.warns(
        UserWarning, match=rf"Ignoring (incomplete|damaged) checkpoint .*{os.path.basename(ckpt)}.*{reason}"
    ):
        assert resolve_resume(True, out) == os.path.join(out, "checkpoint-2")


# -- item 1: sharded weights are digested like every file ------------------------------------------
def test_weights_swapped_for_shards_of_other_weights_are_refused(run, out):
    """The attack: model.safetensors replaced by an index and a shard holding other weights, COMPLETE
    untouched. Neither resume route may take the other weights."""
    ckpt = os.path.join(out, "checkpoint-4")
    other = {k: torch.full_like(v, 0.5) for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
    os.remove(os.path.join(ckpt, "model.safetensors"))
    save_sharded(other, ckpt, 10**9)
    assert os.path.exists(os.path.join(ckpt, INDEX))
    assert not is_complete(ckpt) and "model.safetensors is missing" in why_damaged(ckpt)
    refused_by_path_and_true(out, ckpt, "model.safetensors is missing")
    resumed = train(out, CFG, resume=True)  # from checkpoint-2: exactly the uninterrupted run, no 0.5 anywhere
    assert all(torch.equal(weights(resumed)[k], v) for k, v in run[1].items())


def test_a_digested_file_that_is_missing_is_damage_even_when_the_sizes_are_not_consulted(out):
    ckpt = os.path.join(out, "checkpoint-4")
    meta = marker(ckpt)
    del meta["files"]["optimizer.pt"]  # the size list no longer names it; the digest table still does
    write_marker(ckpt, meta)
    os.remove(os.path.join(ckpt, "optimizer.pt"))
    assert why_damaged(ckpt) == "optimizer.pt is missing (its COMPLETE marker lists it)"


def test_bit_rot_inside_a_digested_shard_is_caught(out):
    """A checkpoint whose weights are shards (sealed with them): each shard and the index are digested."""
    ckpt = os.path.join(out, "checkpoint-4")
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    os.remove(os.path.join(ckpt, "model.safetensors"))
    shards = save_sharded(tensors, ckpt, 200)
    assert len(shards) > 1
    meta = marker(ckpt)  # sealed as kiln seals: every file's size and digest
    del meta["files"]["model.safetensors"], meta[ALGORITHM]["model.safetensors"]
    for name in (*shards, INDEX):
        meta["files"][name] = os.path.getsize(os.path.join(ckpt, name))
        meta[ALGORITHM][name] = file_digest(os.path.join(ckpt, name))
    write_marker(ckpt, meta)
    assert why_damaged(ckpt) is None and resolve_resume(ckpt, out) == ckpt
    flip(os.path.join(ckpt, shards[-1]), count=4)
    assert is_complete(ckpt)  # same size: only the digest can tell
    refused_by_path_and_true(out, ckpt, f"{shards[-1]} does not match the checksum")


@pytest.mark.parametrize(
    "added",
    [
        INDEX,
        "model-00001-of-00001.safetensors",
        "pytorch_model.bin",
        "optimizer.pt.bak.pt",
        "adapter_model.safetensors",
    ],
)
def test_a_weights_file_added_after_sealing_is_damage(out, added):
    ckpt = os.path.join(out, "checkpoint-4")
    shutil.copyfile(os.path.join(ckpt, "model.safetensors"), os.path.join(ckpt, added))
    refused_by_path_and_true(out, ckpt, f"it holds {added}, which its COMPLETE marker does not list")


def test_results_kiln_evaluate_writes_into_the_folder_are_not_damage(out):
    ckpt = os.path.join(out, "checkpoint-4")
    for name in ("evaluate_results.json", "predict_results.json", "predictions.npy", "notes.txt"):
        open(os.path.join(ckpt, name), "w").write("{}")
    assert why_damaged(ckpt) is None


# -- item 2: downgrade ----------------------------------------------------------------------------
def test_a_stripped_digest_table_is_refused(out):
    ckpt = os.path.join(out, "checkpoint-4")
    meta = marker(ckpt)
    assert meta["version"] == 2 and set(meta[ALGORITHM]) == set(meta["files"])
    del meta[ALGORITHM]
    write_marker(ckpt, meta)
    flip(os.path.join(ckpt, "model.safetensors"))  # what the downgrade would hide
    refused_by_path_and_true(out, ckpt, "records no checksum for")


def test_a_digest_table_missing_one_file_is_refused(out):
    """Also a marker without a version but with digests (kiln before the version field) must cover
    every file it lists."""
    ckpt = os.path.join(out, "checkpoint-4")
    meta = marker(ckpt)
    del meta["version"], meta[ALGORITHM]["optimizer.pt"]
    write_marker(ckpt, meta)
    refused_by_path_and_true(out, ckpt, "records no checksum for optimizer.pt")


def test_markers_of_every_known_version_are_read_and_empty_files_count(out):
    """Version 1 (the field written explicitly) and 2 are judged by their digests; a listed empty file is
    a file like any other."""
    ckpt = os.path.join(out, "checkpoint-4")
    open(os.path.join(ckpt, "empty.json"), "w").close()
    meta = marker(ckpt)
    meta["files"]["empty.json"], meta[ALGORITHM]["empty.json"] = 0, file_digest(os.path.join(ckpt, "empty.json"))
    for version in (1, 2):
        write_marker(ckpt, {**meta, "version": version})
        assert is_complete(ckpt) and why_damaged(ckpt) is None
    write_marker(ckpt, {**meta, "version": 0})
    assert "'version' is not a positive whole number" in why_damaged(ckpt)


def test_a_marker_of_a_newer_kiln_is_refused(out):
    ckpt = os.path.join(out, "checkpoint-4")
    write_marker(ckpt, {**marker(ckpt), "version": 3})
    with pytest.raises(
        ResumeError, match=r"written by a newer kiln \(marker version 3; this kiln reads up to 2\): upgrade kiln"
    ):
        resolve_resume(ckpt, out)


# -- item 3: a kiln checkpoint never passes for HF's ----------------------------------------------
KILN_ONLY = ("COMPLETE", "config.yaml", "loop_state_0.pt")


@pytest.mark.parametrize("also", [(), ("kiln_loop_position.json", "precision.pt")])
def test_a_kiln_checkpoint_that_lost_its_marker_is_damaged_not_foreign(run, out, also):
    ckpt = os.path.join(out, "checkpoint-4")
    for name in (*KILN_ONLY, *also):
        os.remove(os.path.join(ckpt, name))
    rot_tail(os.path.join(ckpt, "model.safetensors"))  # damaged weights, which no check would see as HF's
    assert not is_hf_checkpoint(ckpt)
    what = "kiln_loop_position.json" if not also else r"model.safetensors \(kiln's metadata\)"
    with pytest.raises(ResumeError, match=rf"holds kiln's own files \(.*{what}.*\) but no COMPLETE marker"):
        resolve_resume(ckpt, out)
    with pytest.warns(UserWarning, match=r"Ignoring incomplete checkpoint .*checkpoint-4 .*kiln's own files"):
        assert resolve_resume(True, out) == os.path.join(out, "checkpoint-2")


def hf_checkpoint(ckpt: str) -> None:
    """Make a kiln checkpoint look as HF's Trainer writes one: none of kiln's files, HF's metadata."""
    for name in (*KILN_ONLY, "kiln_loop_position.json", "precision.pt"):
        os.remove(os.path.join(ckpt, name))
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file(tensors, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})


def test_a_genuine_hf_checkpoint_resumes(out):
    ckpt = os.path.join(out, "checkpoint-4")
    hf_checkpoint(ckpt)
    assert is_hf_checkpoint(ckpt) and resolve_resume(ckpt, out) == ckpt and resolve_resume(True, out) == ckpt


def _nan(ckpt: str) -> None:
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    tensors["inp.weight"][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


def _truncated(ckpt: str) -> None:
    path = os.path.join(ckpt, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-5])


def _garbled_header(ckpt: str) -> None:
    path = os.path.join(ckpt, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[8:40] = b"\xff" * 32  # inside the JSON header: the same size, no longer readable
    open(path, "wb").write(bytes(data))


def _shard_missing(ckpt: str) -> None:
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    os.remove(os.path.join(ckpt, "model.safetensors"))
    os.remove(os.path.join(ckpt, save_sharded(tensors, ckpt, 200)[0]))


def _tensor_moved(ckpt: str) -> None:
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    os.remove(os.path.join(ckpt, "model.safetensors"))
    save_sharded(tensors, ckpt, 200)
    index = json.loads(open(os.path.join(ckpt, INDEX)).read())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["out.bias"] = shards[0] if index["weight_map"]["out.bias"] != shards[0] else shards[1]
    open(os.path.join(ckpt, INDEX), "w").write(json.dumps(index))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_nan, r"model.safetensors holds non-finite values \(nan or inf\) in inp.weight"),
        (_truncated, "model.safetensors is truncated or its header is damaged"),
        (_garbled_header, "model.safetensors is truncated or its header is damaged"),
        (_shard_missing, r"model-00001-of-\d+.safetensors is missing"),
        (_tensor_moved, "lacks out.bias, which model.safetensors.index.json places there"),
    ],
)
def test_an_hf_checkpoint_with_bad_weights_is_refused(out, damage, reason):
    ckpt = os.path.join(out, "checkpoint-4")
    hf_checkpoint(ckpt)
    damage(ckpt)
    assert is_hf_checkpoint(ckpt)
    refused_by_path_and_true(out, ckpt, reason)
    assert latest_checkpoint(out) == ckpt  # only a resume vets it (reading every weight costs a pass)
