"""Checksums and the marker's schema: what tells a damaged checkpoint from an intact one.

File sizes (the COMPLETE marker's `files`) catch a checkpoint cut off half-way, but not flipped bytes
(a failing disk, a bad copy) or an edited file: those would resume silently to different weights. So
every file's xxh3-64 digest is recorded in the marker when the checkpoint is sealed, read back from the
page cache right after the write while the files are fsynced (xxh3 runs at several GB/s: a few percent
of the save time, measured in bench/checkpoint_io.py), and checked before a resume trusts the folder.

Every file the marker lists is digested, weights shards and indexes included, and a digested file that
is missing is damage, never skipped: replacing `model.safetensors` by an index and shards holding other
weights is refused. So is a file kiln would read that the marker does not list (weights, optimizer or
state files added after the checkpoint was sealed).

The marker records its `version` (`VERSION`). A checkpoint of a kiln that records digests (a version, or
a digest table) must carry a digest for every file it lists; only markers that predate digests (no
version and no digest table) are judged by their sizes, with a warning. Unkeyed digests stop damage, not
a forger who rewrites them too: that is what signing is for (kiln.engine.checkpoint.signing)."""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

from kiln.utils.errors import CheckpointError

ALGORITHM = "xxh3_64"
#: the marker's format: 2 records `version` and digests every file (1: digests without `version`; none: sizes only)
VERSION = 2
MARKER = "COMPLETE"
_CHUNK = 8 << 20
_STEP = re.compile(r"^checkpoint-(\d+)$")
#: what kiln (or a library it hands the folder to) reads from a checkpoint: such a file must be in the marker
_READ_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".metadata", ".json", ".yaml")
#: files `kiln evaluate` / `kiln predict` write into the folder they scored, after it was sealed
_RESULTS = frozenset({"evaluate_results.json", "predict_results.json"})


def _hasher() -> Any:
    import xxhash

    return xxhash.xxh3_64()


def file_digest(path: str) -> str:
    """xxh3-64 of the file's bytes, as hex. Hashed straight from the page cache through a memory map
    (no copy into a buffer): right after a save the file is still cached, so this costs one pass of xxh3."""
    import mmap

    digest = _hasher()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for start in range(0, size, _CHUNK):
                        digest.update(view[start : start + _CHUNK])
                finally:
                    view.release()  # before the map closes
    return digest.hexdigest()


def _marker_problem(meta: Any) -> str | None:
    """What is wrong with a parsed marker's shape, or None."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return "it lists no files" if files in ({}, None) else "its 'files' is not a mapping of names to sizes"
    if not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in files.items()):
        return "its 'files' is not a mapping of names to sizes"
    if type(meta.get("step")) is not int:
        return "its 'step' is not a whole number"
    version = meta.get("version")
    if version is not None and (type(version) is not int or version < 1):
        return "its 'version' is not a positive whole number"
    digests = meta.get(ALGORITHM)
    if digests is not None and not (
        isinstance(digests, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in digests.items())
    ):
        return f"its '{ALGORITHM}' is not a mapping of names to checksums"
    if "signature" in meta and not isinstance(meta["signature"], dict):
        return "its 'signature' is not a JSON object"
    return None


def load_marker(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """The COMPLETE marker of the checkpoint folder `path` checked for shape, or why it cannot be used
    (missing, unreadable, truncated, not JSON, of the wrong types, or written by a newer kiln)."""
    file = os.path.join(path, MARKER)
    try:
        with open(file, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        return None, f"it has no {MARKER} marker"
    except (OSError, ValueError) as err:
        return None, f"its {MARKER} marker is damaged: " + (
            str(err.strerror or err) if isinstance(err, OSError) else "not valid JSON, truncated or garbled"
        )
    problem = _marker_problem(meta)
    if problem is not None:
        return None, f"its {MARKER} marker is damaged: {problem}"
    if meta.get("version", 1) > VERSION:
        return None, (
            f"it was written by a newer kiln (marker version {meta['version']}; this kiln reads up to "
            f"{VERSION}): upgrade kiln to use it"
        )
    return meta, None


def read_marker(path: str) -> dict[str, Any]:
    """The checked COMPLETE marker of `path` (load_marker); a CheckpointError in one sentence otherwise."""
    meta, problem = load_marker(path)
    if meta is None:
        raise CheckpointError(f"{path} is incomplete or damaged: {problem}.")
    return meta


def _unlisted(path: str, listed: dict[str, Any]) -> list[str]:
    """Files kiln would read that the marker does not list (added after the checkpoint was sealed)."""
    found = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel not in listed and rel != MARKER and name not in _RESULTS and name.endswith(_READ_SUFFIXES):
                found.append(rel)
    return sorted(found)


def digest_damage(path: str, meta: dict[str, Any]) -> str | None:
    """Why the files of the checkpoint at `path` do not match its (already shape-checked) marker `meta`
    by checksum, or None. A marker that predates digests is judged by sizes alone, with a warning."""
    files, digests = meta["files"], meta.get(ALGORITHM)
    if digests is None and "version" not in meta:
        warnings.warn(
            f"{path} predates checksums (written by an older kiln): it is judged by its file sizes only.", stacklevel=4
        )
    else:
        digests = digests or {}
        if undigested := sorted(set(files) - set(digests)):
            return f"its {MARKER} marker records no checksum for {', '.join(undigested[:5])}"
        for file, expected in digests.items():
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                return f"{file} is missing (its {MARKER} marker lists it)"
            if file_digest(full) != expected:
                return f"{file} does not match the checksum recorded when it was written (changed or damaged since)"
    if extra := _unlisted(path, files):
        return f"it holds {', '.join(extra[:5])}, which its {MARKER} marker does not list (added after it was written)"
    return None


def damage(path: str, meta: dict[str, Any]) -> str | None:
    """Why the checkpoint at `path` (whose marker `meta` already matched its file sizes) cannot be
    trusted, or None: a file whose digest differs from the one recorded or is missing, a file kiln
    would read that is not recorded, or a step that disagrees between the folder name, the marker and
    trainer_state.json."""
    name = os.path.basename(os.path.normpath(path))
    match = _STEP.match(name)
    step = meta["step"]
    if match and int(match.group(1)) != step:
        return f"its folder name says step {match.group(1)} but its {os.path.join(name, MARKER)} says step {step}"
    if reason := digest_damage(path, meta):
        return reason
    state = os.path.join(path, "trainer_state.json")
    if os.path.exists(state):
        try:
            with open(state, encoding="utf-8") as fh:
                saved = json.load(fh).get("global_step")
        except (OSError, ValueError, AttributeError):
            return "trainer_state.json is unreadable"
        if saved is not None and saved != step:
            return f"trainer_state.json says global_step {saved} but the checkpoint was written at step {step}"
    return None
