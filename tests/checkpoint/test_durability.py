"""Direct tests of the durability rules of a checkpoint save (issue 58), each with an injected fault
rather than a comparison of weights: every file and folder is fsynced before the COMPLETE marker is
written and the marker is the last file; the folder appears under its name only by an atomic rename (a
crash before it leaves a `.tmp` folder that resume ignores); rotation renames a folder away before
deleting it (a crash half-way leaves no half-deleted `checkpoint-N`); a marker listing no files, or
damaged (truncated, not JSON, wrong types), is refused in one sentence. docs/contributing.md lists
these rules beside these tests."""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil

import pytest
import torch

from kiln.engine.checkpoint.files import MARKER, is_complete, latest_checkpoint, why_incomplete
from kiln.engine.checkpoint.resume import ResumeError, resolve_resume
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import folders, train, weights
from tests.checkpoint.test_refusals import out, run  # noqa: F401 - fixtures: checkpoint-2 and -4, copied per test


class Kill(BaseException):
    """Stands in for SIGKILL: no `except Exception` clean-up runs."""


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd through /proc (Linux)")
def test_every_file_and_folder_is_fsynced_before_the_marker_and_the_marker_before_the_rename(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    tmp = os.path.join(out, ".checkpoint-2.tmp")
    events: list[tuple[str, str, bool]] = []  # (what, path, whether the marker existed by then)
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", _path_of(fd), os.path.exists(os.path.join(tmp, MARKER))))
        real_fsync(fd)

    def replace(src, dst):  # type: ignore[no-untyped-def]
        events.append(("rename", f"{src} -> {dst}", os.path.exists(os.path.join(tmp, MARKER))))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    train(out, {"max_steps": 2, "save_steps": 2})
    final = os.path.join(out, "checkpoint-2")
    files = sorted(os.path.relpath(os.path.join(root, n), final) for root, _, names in os.walk(final) for n in names)
    dirs = sorted(os.path.relpath(root, final) for root, _, _ in os.walk(final))
    synced_before_marker = {
        os.path.relpath(p, tmp)
        for what, p, marker in events
        if what == "fsync" and not marker and (p == tmp or p.startswith(tmp + os.sep))
    }
    assert set(files) - {MARKER} <= synced_before_marker, "a file was not fsynced before COMPLETE was written"
    assert set(dirs) <= synced_before_marker, "a folder's entries were not fsynced before COMPLETE was written"
    assert MARKER not in synced_before_marker  # the marker came last: written after every other fsync
    order = [(what, p) for what, p, _ in events]
    rename = order.index(("rename", f"{tmp} -> {final}"))
    assert order.index(("fsync", os.path.join(tmp, MARKER))) < rename  # the marker is durable before the rename
    assert ("fsync", tmp) in order[order.index(("fsync", os.path.join(tmp, MARKER))) : rename]  # and its entry
    assert ("fsync", out) in order[rename:], "the rename itself was not made durable (parent folder fsync)"
    assert all(not p.startswith(tmp + os.sep) for what, p in order[rename:] if what == "fsync")


def test_a_crash_before_the_rename_leaves_only_a_tmp_folder_that_resume_ignores(tmp_path, monkeypatch):
    cfg = {"max_steps": 6, "save_steps": 2}
    straight = weights(train(str(tmp_path / "straight"), cfg))
    out = str(tmp_path / "run")
    real_replace = os.replace
    seen = []

    def replace(src, dst):  # type: ignore[no-untyped-def]
        if os.path.basename(dst) == "checkpoint-4":
            seen.append(os.path.exists(dst))
            assert is_complete(src), "the folder is renamed into place before it is complete"
            raise Kill("killed right before the rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Kill):
        train(out, cfg)
    assert seen == [False]  # checkpoint-4 never existed under its name before the rename
    assert folders(out) == {"checkpoint-2", ".checkpoint-4.tmp"}
    assert latest_checkpoint(out, verify=True) == os.path.join(out, "checkpoint-2")
    monkeypatch.setattr(os, "replace", real_replace)
    resumed = train(out, cfg, model_seed=3, resume=True)
    assert all(torch.equal(weights(resumed)[k], v) for k, v in straight.items())
    assert ".checkpoint-4.tmp" not in folders(out)  # debris cleared by the next save


def test_a_crash_half_way_through_rotation_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kw):  # type: ignore[no-untyped-def]
        if "checkpoint-2" in os.path.basename(path) and os.path.isdir(path):
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))  # one file gone, then the process dies
            raise Kill("killed while deleting")
        return real_rmtree(path, *args, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(Kill):
        train(out, {"max_steps": 4, "save_steps": 2, "save_total_limit": 1})
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    named = [n for n in folders(out) if n.startswith("checkpoint-")]
    assert named == ["checkpoint-4"] and is_complete(os.path.join(out, "checkpoint-4"))
    assert folders(out) == {"checkpoint-4", ".checkpoint-2.deleting"}  # hidden, and cleared by the next save
    train(out, {"max_steps": 6, "save_steps": 2, "save_total_limit": 1}, resume=True)
    assert folders(out) == {"checkpoint-6"}


def test_an_io_error_after_the_rename_is_still_one_sentence(tmp_path, monkeypatch):
    """The output folder's fsync (which makes the rename durable) fails: the temporary folder is already
    renamed away, and the clean-up after the failure must not trip over it: kiln's one sentence naming
    the errno, not a FileNotFoundError from the clean-up."""
    from kiln.engine.checkpoint import atomic

    out = str(tmp_path / "run")
    real_fsync_dir = atomic._fsync_dir

    def fsync_dir(path: str) -> None:
        if os.path.basename(path) == "run":
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        real_fsync_dir(path)

    monkeypatch.setattr(atomic, "_fsync_dir", fsync_dir)
    with pytest.raises(CheckpointError, match=r"\(EIO\) while writing checkpoint-2 in .*Check the disk"):
        train(out, {"max_steps": 2, "save_steps": 2})
    assert folders(out) == {"checkpoint-2"} and is_complete(os.path.join(out, "checkpoint-2"))


def _staged(out, text: str) -> str:
    tmp = out / ".checkpoint-2.tmp"
    tmp.mkdir()
    (tmp / "weights.bin").write_text(text)
    return str(tmp)


def test_a_step_published_twice_replaces_the_first_and_leaves_no_old_folder(tmp_path):
    """A step save and the epoch-end save of the same step: the second folder takes the name, and neither
    the first nor a leftover `.old` of a run killed there stays behind (or blocks the rename)."""
    from kiln.engine.checkpoint.atomic import publish_folder

    final = str(tmp_path / "checkpoint-2")
    publish_folder(_staged(tmp_path, "first"), final, {"step": 2}, None)
    (tmp_path / ".checkpoint-2.old").mkdir()  # what a kill between the two renames leaves
    (tmp_path / ".checkpoint-2.old" / "weights.bin").write_text("older")
    publish_folder(_staged(tmp_path, "second"), final, {"step": 2}, None)
    assert folders(str(tmp_path)) == {"checkpoint-2"} and is_complete(final)
    assert (tmp_path / "checkpoint-2" / "weights.bin").read_text() == "second"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd through /proc (Linux)")
def test_the_marker_is_whole_on_disk_when_it_is_fsynced(tmp_path, monkeypatch):
    """fsync makes durable what the OS has: the marker's text must have left Python's buffer by then."""
    from kiln.engine.checkpoint.atomic import publish_folder

    sizes: dict[str, int] = {}
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        sizes[os.path.basename(_path_of(fd))] = os.fstat(fd).st_size
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = str(tmp_path / "checkpoint-2")
    publish_folder(_staged(tmp_path, "weights"), final, {"step": 2}, None)
    assert sizes[MARKER] == os.path.getsize(os.path.join(final, MARKER)) > 0


# -- the marker ---------------------------------------------------------------------------------------
def _refused_in_one_sentence(out: str, reason: str) -> str:
    ckpt = os.path.join(out, "checkpoint-4")
    assert not is_complete(ckpt)
    with pytest.raises(ResumeError) as err:
        resolve_resume(ckpt, out)
    message = str(err.value)
    assert reason in message and "\n" not in message and message.count(". ") <= 1, message
    with pytest.warns(UserWarning, match=r"Ignoring incomplete checkpoint .*checkpoint-4"):
        assert resolve_resume(True, out) == os.path.join(out, "checkpoint-2")
    return message


def test_a_marker_listing_no_files_is_rejected(out):
    ckpt = os.path.join(out, "checkpoint-4")
    meta = json.loads(open(os.path.join(ckpt, MARKER)).read())
    meta["files"] = {}
    open(os.path.join(ckpt, MARKER), "w").write(json.dumps(meta))
    message = _refused_in_one_sentence(out, "(its COMPLETE marker is damaged: it lists no files)")
    assert message.startswith(f"{ckpt} is incomplete or damaged (its COMPLETE marker is damaged: it lists no files); ")


def _edit(change):  # type: ignore[no-untyped-def]
    def damage(text: str) -> str:
        meta = json.loads(text)
        change(meta)
        return json.dumps(meta)

    return damage


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda text: text[: len(text) // 2], "not valid JSON, truncated or garbled"),
        (lambda text: "", "not valid JSON, truncated or garbled"),
        (lambda text: "\x00\x01garbage", "not valid JSON, truncated or garbled"),
        (lambda text: "[1, 2]", "not a JSON object"),
        (_edit(lambda m: m.update(files=list(m["files"]))), "its 'files' is not a mapping of names to sizes"),
        (
            _edit(lambda m: m["files"].update({"optimizer.pt": "5475"})),
            "its 'files' is not a mapping of names to sizes",
        ),
        (_edit(lambda m: m["files"].update({"optimizer.pt": -1})), "its 'files' is not a mapping of names to sizes"),
        (_edit(lambda m: m.pop("files")), "it lists no files"),
        (_edit(lambda m: m.update(step="4")), "its 'step' is not a whole number"),
        (_edit(lambda m: m.update(step=True)), "its 'step' is not a whole number"),
        (_edit(lambda m: m.update(version="2")), "its 'version' is not a positive whole number"),
        (_edit(lambda m: m.update(xxh3_64=["a"])), "its 'xxh3_64' is not a mapping of names to checksums"),
        (
            _edit(lambda m: m["xxh3_64"].update({"optimizer.pt": 7})),
            "its 'xxh3_64' is not a mapping of names to checksums",
        ),
        (_edit(lambda m: m.update(signature="forged")), "its 'signature' is not a JSON object"),
    ],
    ids=[
        "truncated",
        "empty",
        "binary",
        "list",
        "files-list",
        "size-str",
        "size-negative",
        "no-files",
        "step-str",
        "step-bool",
        "version-str",
        "digests-list",
        "digest-int",
        "signature-str",
    ],
)
def test_a_damaged_marker_is_rejected_in_one_sentence(out, damage, reason):
    path = os.path.join(out, "checkpoint-4", MARKER)
    text = open(path).read()
    open(path, "w").write(damage(text))
    _refused_in_one_sentence(out, reason)


def test_a_listed_file_of_another_size_is_named(out):
    ckpt = os.path.join(out, "checkpoint-4")
    with open(os.path.join(ckpt, "optimizer.pt"), "ab") as fh:
        fh.write(b"x")
    assert why_incomplete(ckpt).startswith("optimizer.pt is ") and "not the" in why_incomplete(ckpt)
    assert glob.glob(os.path.join(out, ".checkpoint-*")) == []
