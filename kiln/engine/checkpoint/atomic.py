"""How a checkpoint folder comes into place atomically: written as `.checkpoint-<step>.tmp`, every file fsynced,
the COMPLETE marker (the files, their digests and, with save.signing_key_env, a signature) written and fsynced
last, then the folder renamed to `checkpoint-<step>`. A run killed at any point leaves either the previous
checkpoints untouched or the new one complete, plus hidden debris that the next run clears."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

from kiln.engine.checkpoint.files import MARKER, PREFIX, _fsync_dir, _fsync_tree
from kiln.engine.checkpoint.integrity import ALGORITHM
from kiln.engine.checkpoint.signing import SIGNATURE, SigningKey, sign

_DEBRIS = re.compile(rf"^\.{PREFIX}\d+\.(tmp|old|deleting)$")


def publish_folder(tmp: str, final: str, meta: dict[str, Any], signing_key: SigningKey | None) -> None:
    """fsync everything in `tmp`, write the marker `meta` last (signed with `signing_key`), then rename the
    folder to `final`."""
    meta["files"], meta[ALGORITHM] = _fsync_tree(tmp)
    if signing_key is not None:
        meta[SIGNATURE] = sign(meta, signing_key)
    with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    out = os.path.dirname(final)
    old = os.path.join(out, f".{os.path.basename(final)}.old")
    if os.path.exists(final):  # same step saved twice (e.g. a step save and the epoch-end save)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(out)
    shutil.rmtree(old, ignore_errors=True)


def clear_debris(out: str) -> None:
    """Remove the hidden leftovers in `out` of a run killed while saving or rotating."""
    for name in os.listdir(out):
        if _DEBRIS.match(name):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
