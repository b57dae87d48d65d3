"""Checksums that tell a damaged checkpoint from an intact one.

File sizes (the COMPLETE marker's `files`) catch a checkpoint cut off half-way, but not flipped bytes
(a failing disk, a bad copy) or an edited file: those would resume silently to different weights. So
every file's xxh3-64 digest is recorded in the marker when the checkpoint is sealed, read back from the
page cache right after the write while the files are fsynced (xxh3 runs at several GB/s: a few percent
of the save time, measured in bench/checkpoint_io.py), and checked before a resume trusts the folder. Checkpoints of older kiln
versions carry no digests and are judged by their sizes alone."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20
_STEP = re.compile(r"^checkpoint-(\d+)$")


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
                        digest.update(view[start:start + _CHUNK])
                finally:
                    view.release()  # before the map closes
    return digest.hexdigest()


def damage(path: str, meta: dict[str, Any]) -> Optional[str]:
    """Why the checkpoint at `path` (whose marker `meta` already matched its file sizes) cannot be
    trusted, or None: a file whose digest differs from the one recorded, or a step that disagrees
    between the folder name, the marker and trainer_state.json."""
    name = os.path.basename(os.path.normpath(path))
    match = _STEP.match(name)
    step = meta.get("step")
    if match and isinstance(step, int) and int(match.group(1)) != step:
        return f"its folder name says step {match.group(1)} but its {os.path.join(name, 'COMPLETE')} says step {step}"
    digests = meta.get(ALGORITHM)
    if isinstance(digests, dict):
        for file, expected in digests.items():
            full = os.path.join(path, file)
            if not os.path.exists(full):  # a weights file deliberately re-saved as shards (files.is_complete)
                continue
            if file_digest(full) != expected:
                return f"{file} does not match the checksum recorded when it was written (changed or damaged since)"
    state = os.path.join(path, "trainer_state.json")
    if isinstance(step, int) and os.path.exists(state):
        try:
            with open(state, encoding="utf-8") as fh:
                saved = json.load(fh).get("global_step")
        except (OSError, ValueError, AttributeError):
            return "trainer_state.json is unreadable"
        if saved is not None and saved != step:
            return f"trainer_state.json says global_step {saved} but the checkpoint was written at step {step}"
    return None
