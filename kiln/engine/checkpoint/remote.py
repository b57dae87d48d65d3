"""Checkpoints on an object store, addressed by an fsspec URL (`s3://bucket/run`, `gs://...`, `memory://...`).

A checkpoint is first written and made durable in a local folder exactly as on disk (files.py); this module
then mirrors it to the store and back, keeping the local rules on a store that has no rename:

- **Upload**: every file but the COMPLETE marker, each with retries and exponential backoff (s3fs splits a
  large file into a multipart upload), then the marker, last. A checkpoint whose marker is on the store is
  whole; an upload cut short (a failure that outlives the retries, a killed process) leaves no marker, so
  the previous checkpoint stays the newest intact one.
- **Rotation**: the marker is deleted first, then the files, so a half-deleted checkpoint is never taken
  for an intact one.
- **Resume**: only the newest checkpoint with a marker is downloaded, into a temporary folder, its digests
  checked (files.why_damaged) before it is renamed into place; a damaged one is skipped, with a warning,
  for the one before it.
- **The run lock**: one run per store prefix, taken by an exclusive create of `.kiln-run.lock` (S3's
  `If-None-Match: *`); a store that cannot create exclusively is refused in one sentence.

The store's package is an extra: `kiln[s3]` (s3fs), `kiln[gcs]` (gcsfs); a URL whose package is missing is
one sentence naming it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from kiln.engine.checkpoint.files import PREFIX, why_damaged, why_incomplete
from kiln.engine.checkpoint.integrity import MARKER
from kiln.engine.checkpoint.output_dir import LOCK, OutputDirInUse
from kiln.utils.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

#: URL scheme -> the kiln extra that installs its fsspec file system
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def is_remote(path: str) -> bool:
    """Whether `path` is a URL of a store other than the local file system."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme not in ("", "file", "local")


class UploadFailed(CheckpointError):
    """A checkpoint could not be uploaded after its retries; the store's previous checkpoints are untouched."""


class RemoteCheckpoints:
    """The checkpoints under one store URL (`checkpoint-<step>` prefixes, as in a local output_dir)."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retries: int = 4,
        backoff: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        import fsspec

        scheme = url.partition("://")[0]
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except ImportError:
            extra = EXTRAS.get(scheme)
            hint = f"pip install kiln[{extra}]" if extra else f"install the fsspec file system for {scheme}://"
            raise ConfigError(f"{url} is on a {scheme}:// store, whose file system is not installed; {hint}.") from None
        self.url, self.retries, self.backoff, self.sleep = url.rstrip("/"), retries, backoff, sleep
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _retrying(self, what: str, action: Callable[[], Any]) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return action()
            except Exception as err:  # the stores' clients raise their own types (botocore, aiohttp, OSError)
                if attempt == self.retries:
                    raise UploadFailed(
                        f"{what} failed after {self.retries + 1} tries ({type(err).__name__}: {err}); "
                        "the store's earlier checkpoints are untouched."
                    ) from err
                delay = self.backoff * 2**attempt
                log.warning("%s failed (%s: %s); retrying in %.1f s.", what, type(err).__name__, err, delay)
                self.sleep(delay)

    # -- writing ------------------------------------------------------------------------------
    def upload(self, local: str) -> str:
        """Mirror the complete local checkpoint folder `local` to the store, its marker last; returns its URL."""
        problem = why_incomplete(local)
        if problem is not None:
            raise CheckpointError(f"{local} is not a complete checkpoint ({problem}), so it is not uploaded.")
        name = os.path.basename(os.path.normpath(local))
        files = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
        for rel in [f for f in files if f != MARKER] + [MARKER]:
            target = self._path(name, *rel.split(os.sep))
            self._retrying(
                f"Uploading {rel} of {name} to {self.url}",
                functools.partial(self.fs.put_file, os.path.join(local, rel), target),
            )
        return f"{self.url}/{name}"

    def delete(self, name: str) -> None:
        """Remove checkpoint `name` from the store: its marker first, so it is never half there and intact."""
        marker = self._path(name, MARKER)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        if self.fs.exists(self._path(name)):
            self.fs.rm(self._path(name), recursive=True)

    # -- reading ------------------------------------------------------------------------------
    def steps(self) -> list[tuple[int, str]]:
        """(step, name) of every checkpoint whose marker is on the store, oldest first."""
        found = []
        for entry in self.fs.ls(self.root, detail=False) if self.fs.exists(self.root) else []:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit() and self.fs.exists(self._path(name, MARKER)):
                found.append((int(name[len(PREFIX) :]), name))
        return sorted(found)

    def download_newest(self, local_root: str, key: Any = None) -> str | None:
        """Download the newest intact checkpoint into `local_root/<name>` and return that path (None: the
        store has none). Each candidate's digests are checked before it is put in place; a damaged one is
        skipped, with a warning, for the one before it."""
        os.makedirs(local_root, exist_ok=True)
        for _, name in reversed(self.steps()):
            final = os.path.join(local_root, name)
            if os.path.isdir(final) and why_damaged(final, key) is None:
                return final  # downloaded before (a restarted job on the same machine)
            partial = os.path.join(local_root, f".{name}.download")
            shutil.rmtree(partial, ignore_errors=True)
            self.fs.get(self._path(name) + "/", partial + "/", recursive=True)
            problem = why_incomplete(partial) or why_damaged(partial, key)
            if problem is None:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(partial, final)
                return final
            shutil.rmtree(partial, ignore_errors=True)
            warnings.warn(
                f"Ignoring damaged checkpoint {self.url}/{name}: {problem}. Resuming from the previous "
                "intact checkpoint instead.",
                stacklevel=2,
            )
        return None

    # -- the run lock -------------------------------------------------------------------------
    def acquire_lock(self) -> None:
        """Take the store prefix's run lock by an exclusive create; OutputDirInUse names the holder."""
        path = self._path(LOCK)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode("utf-8")
        try:
            with self.fs.open(path, "xb") as f:
                f.write(info)
        except FileExistsError:
            try:
                holder = json.loads(self.fs.cat_file(path))
                who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
            except (OSError, ValueError):
                who = "another process"
            raise OutputDirInUse(
                f"output_dir {self.url!r} is in use by another kiln run ({who}); wait for it to "
                f"finish, or delete {self.url}/{LOCK} if that run is dead."
            ) from None
        except (NotImplementedError, ValueError) as err:
            raise ConfigError(
                f"{self.url} is on a store that cannot create a file exclusively ({err}), so two runs "
                "could write the same checkpoints; use an S3 or GCS bucket, or a local output_dir."
            ) from None

    def release_lock(self) -> None:
        path = self._path(LOCK)
        if self.fs.exists(path):
            self.fs.rm_file(path)
