"""Checkpoint folders on disk: naming, fsync, the COMPLETE marker, discovery and validation.

Only folders named `checkpoint-<step>` whose marker lists every file with its size are trusted;
`latest_checkpoint` skips anything else with a warning."""

from __future__ import annotations

import os
import re
import shutil
import warnings

from kiln.engine.checkpoint.hf_folder import hf_weights_damage, is_hf_checkpoint, missing_marker_reason
from kiln.engine.checkpoint.integrity import MARKER, damage, load_marker, read_marker
from kiln.engine.checkpoint.integrity import file_digest as digest_file
from kiln.engine.checkpoint.signing import SigningKey, signature_problem

PREFIX = "checkpoint-"
#: the engine's own files in a checkpoint (the strategy's CheckpointIO writes the model and optimizer)
STATE = "trainer_state.json"
#: kiln's loop position (epoch, batches into it): kept out of trainer_state.json, whose schema is HF's
POSITION = "kiln_loop_position.json"
RNG = "rng_state_{rank}.pth"
LOOP = "loop_state_{rank}.pt"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")
__all__ = [
    "MARKER",
    "PREFIX",
    "is_complete",
    "is_hf_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "read_marker",
    "why_damaged",
    "why_incomplete",
]


def hf_damage(path: str, key: SigningKey | None) -> str | None:
    """Why the HF checkpoint at `path` must not be resumed: unsigned where a key is configured, or
    weights that fail the checks an unrecorded folder allows (kiln.engine.checkpoint.hf_folder)."""
    if key is not None:
        return (
            f"it was written by HF's Trainer and is not signed, and this run requires checkpoints signed with the "
            f"key in {key.env} (save.signing_key_env)"
        )
    return hf_weights_damage(path)


# -- files on disk -------------------------------------------------------------------------------
def _fsync_tree(directory: str) -> tuple[dict[str, int], dict[str, str]]:
    """fsync every file, then every folder holding them (their entries), so the marker written next
    never outlives its data after a crash; return each file's size and checksum
    (kiln.engine.checkpoint.integrity). The fsyncs wait on the disk while the checksums keep a core
    busy, so they run side by side: the checksums then cost little of the save."""
    from concurrent.futures import ThreadPoolExecutor

    walked = list(os.walk(directory))
    paths = [os.path.join(root, name) for root, _, files in walked for name in files]
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="kiln-fsync") as pool:
        synced = [pool.submit(_fsync_file, path) for path in paths]
        digests = {os.path.relpath(path, directory): digest_file(path) for path in paths}
        for done in synced:
            done.result()
    for root, _, _ in reversed(walked):  # deepest first: a folder's own entry is in its parent
        _fsync_dir(root)
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


def why_incomplete(path: str) -> str | None:
    """Why `path` is not a complete checkpoint (no marker, a damaged marker, a listed file missing or of
    another size than recorded), or None."""
    if not os.path.exists(os.path.join(path, MARKER)):
        return missing_marker_reason(path)
    meta, problem = load_marker(path)
    if meta is None:
        return problem
    for name, size in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing (its {MARKER} marker lists it)"
        if os.path.getsize(file) != size:
            return f"{name} is {os.path.getsize(file)} bytes, not the {size} its {MARKER} marker records"
    return None


def is_complete(path: str) -> bool:
    """True when `path` has a well-formed marker and every file it lists exists with the recorded size."""
    return why_incomplete(path) is None


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-<step>` folder, oldest first (complete or not)."""
    if not os.path.isdir(output_dir):
        return []
    found = [
        (int(m.group(1)), os.path.join(output_dir, name))
        for name in os.listdir(output_dir)
        if (m := _STEP.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    return sorted(found)


def kept(complete: list[str], limit: int, best: str | None) -> set[str]:
    """Which of the `complete` checkpoints (oldest first) rotation keeps: the newest `limit`, and the best
    one (`best`) always, which counts towards the limit unless the limit is 1 (HF: limit 5 keeps the 4
    newest plus the best; limit 1 keeps the newest and the best)."""
    keep = set(complete[-limit:])
    if best in complete and best not in keep:
        keep = set(complete[-(limit - 1) :]) if limit > 1 else keep
        keep.add(best)
    return keep


def why_damaged(path: str, key: SigningKey | None = None) -> str | None:
    """Why a complete-looking kiln checkpoint must not be read (its signature under the signing policy
    with `key`, a checksum, a missing or unrecorded file, a step mismatch), or None."""
    meta, problem = load_marker(path)
    if meta is None:
        return problem
    try:
        return signature_problem(meta, key) or damage(path, meta)
    except OSError as err:
        return f"{os.path.relpath(err.filename or path, path)} is unreadable ({err.strerror})"


def latest_checkpoint(output_dir: str, verify: bool = False, key: SigningKey | None = None) -> str | None:
    """Newest complete checkpoint (or one written by HF's Trainer, which has no marker); incomplete
    ones are skipped with a warning. With `verify` (resume), every file's checksum, the step and the
    signature (with `key`; kiln.engine.checkpoint.signing) are checked too, an HF checkpoint's weights
    are vetted, and a damaged checkpoint is skipped with a warning for the previous intact one."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if is_hf_checkpoint(path):
            reason = hf_damage(path, key) if verify else None
        elif (incomplete := why_incomplete(path)) is not None:
            warnings.warn(f"Ignoring incomplete checkpoint {path} ({incomplete}).", stacklevel=2)
            continue
        else:
            reason = why_damaged(path, key) if verify else None
        if reason is None:
            return path
        warnings.warn(
            f"Ignoring damaged checkpoint {path}: {reason}. Resuming from the previous intact checkpoint instead.",
            stacklevel=2,
        )
    return None
