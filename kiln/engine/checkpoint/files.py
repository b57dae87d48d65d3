"""Checkpoint folders on disk: naming, fsync, the COMPLETE marker, discovery and validation.

Only folders named `checkpoint-<step>` whose marker lists every file with its size are trusted;
`latest_checkpoint` skips anything else with a warning."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any, Optional

from kiln.engine.checkpoint.integrity import damage, file_digest as digest_file
from kiln.utils.errors import CheckpointError

PREFIX = "checkpoint-"
MARKER = "COMPLETE"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


# -- files on disk -------------------------------------------------------------------------------
def _fsync_tree(directory: str) -> tuple[dict[str, int], dict[str, str]]:
    """fsync every file (so the marker never outlives its data after a crash); return each file's
    size and checksum (kiln.engine.checkpoint.integrity). The fsyncs wait on the disk while the
    checksums keep a core busy, so they run side by side: the checksums then cost little of the save."""
    from concurrent.futures import ThreadPoolExecutor

    paths = [os.path.join(root, name) for root, _, files in os.walk(directory) for name in files]
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="kiln-fsync") as pool:
        synced = [pool.submit(_fsync_file, path) for path in paths]
        digests = {os.path.relpath(path, directory): digest_file(path) for path in paths}
        for done in synced:
            done.result()
    sizes = {os.path.relpath(path, directory): os.path.getsize(path) for path in paths}
    return sizes, digests


def _fsync_file(path: str) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Delete a checkpoint folder so that a crash half-way never leaves a half-deleted
    `checkpoint-<step>`: it is renamed to a hidden name first, then removed."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f".{name}.deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def is_complete(path: str) -> bool:
    """True when `path` has a marker and every file it lists exists with the recorded size.

    One deliberate change is not damage: weights re-saved as sharded safetensors (an index and
    intact shards in place of the single weights file the marker lists)."""
    try:
        meta = read_marker(path)
        return bool(meta["files"]) and all(_file_matches(path, f, size) for f, size in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError):
        return False


def _file_matches(path: str, name: str, size: int) -> bool:
    file = os.path.join(path, name)
    if os.path.exists(file):
        return os.path.getsize(file) == size
    from kiln.strategies.weights_files import sharded_weights_intact

    return name in _WEIGHTS and sharded_weights_intact(path)


def read_marker(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} has no readable {MARKER} marker ({err}); it is incomplete or damaged.") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}/{MARKER} is damaged (not a JSON object).")
    return meta


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-<step>` folder, oldest first (complete or not)."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := _STEP.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return sorted(found)


def is_hf_checkpoint(path: str) -> bool:
    """A folder HF's Trainer wrote: its trainer_state.json and none of kiln's own files (a kiln
    checkpoint without its marker is damaged, not foreign)."""
    return (os.path.isfile(os.path.join(path, "trainer_state.json"))
            and not any(os.path.exists(os.path.join(path, f)) for f in (MARKER, "config.yaml", "loop_state_0.pt")))


def why_damaged(path: str) -> Optional[str]:
    """Why a complete-looking kiln checkpoint must not be resumed (a checksum or step mismatch), or None."""
    try:
        return damage(path, read_marker(path))
    except (OSError, CheckpointError) as err:
        return str(err)


def latest_checkpoint(output_dir: str, verify: bool = False) -> Optional[str]:
    """Newest complete checkpoint (or one written by HF's Trainer, which has no marker); incomplete
    ones are skipped with a warning. With `verify` (resume), every file's checksum and the step are
    checked too, and a damaged checkpoint is skipped with a warning for the previous intact one."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if is_hf_checkpoint(path):
            return path
        if not is_complete(path):
            warnings.warn(f"Ignoring incomplete checkpoint {path} (its {MARKER} marker is missing or does not match its files).",
                          stacklevel=2)
            continue
        reason = why_damaged(path) if verify else None
        if reason is None:
            return path
        warnings.warn(f"Ignoring damaged checkpoint {path}: {reason}. Resuming from the previous intact checkpoint instead.",
                      stacklevel=2)
    return None

