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
- **The run lock**: one run per store prefix, a lease on `.kiln-run.lock` that the holder keeps renewing
  and that another run takes over once it expires (lease.py). Every upload, deletion and rotation first
  checks that the lock is still this run's: a run whose lease was taken over stops (LeaseLost) rather
  than write over the new holder's checkpoints.

The store's package is an extra: `kiln[s3]` (s3fs), `kiln[gcs]` (gcsfs); a URL whose package is missing is
one sentence naming it.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from kiln.engine.checkpoint.files import PREFIX, kept, why_damaged, why_incomplete
from kiln.engine.checkpoint.in_use import FINISHED_FILES, LOCK
from kiln.engine.checkpoint.integrity import MARKER
from kiln.engine.checkpoint.lease import LEASE_SECONDS, Lease, LeaseLost
from kiln.utils.errors import CheckpointError
from kiln.utils.storage_urls import EXTRAS, is_remote, missing_file_system

__all__ = ["EXTRAS", "LeaseLost", "RemoteCheckpoints", "UploadFailed", "is_remote"]

log = logging.getLogger(__name__)

#: store prefixes whose run lock this process holds -> its lease
_held: dict[str, Lease] = {}


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
        lease: float = LEASE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import fsspec

        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except ImportError:
            raise missing_file_system(url) from None
        self.url, self.retries, self.backoff, self.sleep = url.rstrip("/"), retries, backoff, sleep
        self.lease, self.clock = lease, clock  # the run lock's lease length and the clock it is judged by
        self.uploaded: str | None = None  # the last checkpoint this object uploaded whole
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
        marker = self._path(name, MARKER)
        self._check_lease()
        if self.fs.exists(marker):  # the same step uploaded again: never half-replaced under an intact marker
            self.fs.rm_file(marker)
            self.uploaded = None if self.uploaded == name else self.uploaded
        files = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
        for rel in [f for f in files if f != MARKER] + [MARKER]:
            if rel == MARKER:
                self._check_lease()  # the lease may have been lost during a long upload
            target = self._path(name, *rel.split(os.sep))
            self._retrying(
                f"Uploading {rel} of {name} to {self.url}",
                functools.partial(self.fs.put_file, os.path.join(local, rel), target),
            )
        self.uploaded = name
        return f"{self.url}/{name}"

    def withdraw(self, name: str) -> None:
        """Delete checkpoint `name`'s marker from the store, if there, before its files are uploaded again:
        never half-replaced under an intact marker."""
        marker = self._path(name, MARKER)
        self._check_lease()
        if self.fs.exists(marker):
            self.fs.rm_file(marker)

    def upload_some(self, local: str, files: list[str]) -> None:
        """Upload the files `files` (paths relative to the checkpoint folder `local`), with retries, but no
        marker: one node's part of a checkpoint whose marker global rank 0 writes (remote_run)."""
        name = os.path.basename(os.path.normpath(local))
        self._check_lease()
        for rel in files:
            self._retrying(
                f"Uploading {rel} of {name} to {self.url}",
                functools.partial(self.fs.put_file, os.path.join(local, rel), self._path(name, *rel.split(os.sep))),
            )

    def seal(self, name: str, marker: bytes) -> str:
        """Upload checkpoint `name`'s marker, whose files are all on the store; returns its URL."""
        self._check_lease()
        self._retrying(
            f"Uploading {MARKER} of {name} to {self.url}",
            functools.partial(self.fs.pipe_file, self._path(name, MARKER), marker),
        )
        return f"{self.url}/{name}"

    def delete(self, name: str) -> None:
        """Remove checkpoint `name` from the store: its marker first, so it is never half there and intact."""
        marker = self._path(name, MARKER)
        self._check_lease()
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        if self.fs.exists(self._path(name)):
            self.fs.rm(self._path(name), recursive=True)

    def rotate(self, limit: int, best: str | None) -> None:
        """Keep the newest `limit` checkpoints on the store, and the best one (named `best`), by the local
        rule (files.kept)."""
        names = [name for _, name in self.steps()]
        keep = kept(names, limit, best)
        for name in names:
            if name not in keep:
                self.delete(name)

    def upload_files(self, local: str) -> None:
        """Upload the files at the top of folder `local` (a finished run's exported model, its
        trainer_state.json and results), each with retries; not the run lock, nor any folder."""
        self._check_lease()
        for name in sorted(os.listdir(local)):
            source = os.path.join(local, name)
            if name != LOCK and os.path.isfile(source):
                self._retrying(
                    f"Uploading {name} to {self.url}", functools.partial(self.fs.put_file, source, self._path(name))
                )

    # -- reading ------------------------------------------------------------------------------
    def steps(self) -> list[tuple[int, str]]:
        """(step, name) of every checkpoint whose marker is on the store, oldest first."""
        found = []
        self.fs.invalidate_cache(self.root)  # another process (a run's other node) may have written since
        for entry in self.fs.ls(self.root, detail=False) if self.fs.exists(self.root) else []:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit() and self.fs.exists(self._path(name, MARKER)):
                found.append((int(name[len(PREFIX) :]), name))
        return sorted(found)

    def download_newest(self, local_root: str, key: Any = None) -> str | None:
        """Download the newest intact checkpoint into `local_root/<name>` and return that path (None: the
        store has none). Each candidate's digests are checked before it is put in place; a damaged one is
        skipped, with a warning, for the one before it."""
        for _, name in reversed(self.steps()):
            path, problem = self._fetch(name, local_root, key)
            if problem is None:
                return path
            warnings.warn(
                f"Ignoring damaged checkpoint {self.url}/{name}: {problem}. Resuming from the previous "
                "intact checkpoint instead.",
                stacklevel=2,
            )
        return None

    def download(self, name: str, local_root: str, key: Any = None) -> str:
        """Download checkpoint `name` into `local_root/<name>` and return that path; a CheckpointError when
        it has no marker on the store (not uploaded whole) or fails its digests."""
        if not self.fs.exists(self._path(name, MARKER)):
            raise CheckpointError(
                f"{self.url}/{name} is not a complete checkpoint on the store (no {MARKER} marker: missing, or "
                "its upload was cut short); name another checkpoint."
            )
        path, problem = self._fetch(name, local_root, key)
        if problem is not None:
            raise CheckpointError(f"{self.url}/{name} is damaged: {problem}; name another checkpoint.")
        return path

    def _fetch(self, name: str, local_root: str, key: Any) -> tuple[str, str | None]:
        """Bring checkpoint `name` into `local_root/<name>` unless an intact copy is there already (a
        restarted job on the same machine); returns the path and why it must not be read (None: intact)."""
        os.makedirs(local_root, exist_ok=True)
        final = os.path.join(local_root, name)
        if os.path.isdir(final) and why_damaged(final, key) is None and self._same_marker(final, name):
            return final, None
        partial = os.path.join(local_root, f".{name}.download")
        shutil.rmtree(partial, ignore_errors=True)
        self.fs.get(self._path(name) + "/", partial + "/", recursive=True)
        problem = why_incomplete(partial) or why_damaged(partial, key)
        if problem is None:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
        else:
            shutil.rmtree(partial, ignore_errors=True)
        return final, problem

    def _same_marker(self, local: str, name: str) -> bool:
        """Whether the local copy `local` is of the store's checkpoint `name` (the same marker): a node's
        own part of a checkpoint several nodes uploaded has a marker of its own, listing its files only."""
        with open(os.path.join(local, MARKER), "rb") as fh:
            return fh.read() == self.fs.cat_file(self._path(name, MARKER))

    def finished_work(self) -> str | None:
        """The first thing on the store a new run would overwrite (its newest checkpoint, or an exported
        model), or None."""
        steps = self.steps()
        if steps:
            return steps[-1][1]
        return next((name for name in FINISHED_FILES if self.fs.exists(self._path(name))), None)

    # -- the run lock -------------------------------------------------------------------------
    def acquire_lock(self) -> None:
        """Take the store prefix's run lock, a lease kept renewed until release_lock (re-entrant within
        this process); OutputDirInUse names a live holder."""
        if self.url in _held:
            _held[self.url].holds += 1
            return
        lease = Lease(self.fs, self._path(LOCK), self.url, self.lease, self.clock)
        lease.take()
        _held[self.url] = lease

    def release_lock(self) -> None:
        """Drop one hold on the lock; the last one stops renewing it and deletes it (if it is still ours)."""
        lease = _held.get(self.url)
        if lease is None:
            return
        lease.holds -= 1
        if lease.holds == 0:
            del _held[self.url]
            lease.release()

    def _check_lease(self) -> None:
        """Before a write on the store: LeaseLost when this process holds its run lock and lost it."""
        lease = _held.get(self.url)
        if lease is not None:
            lease.verify()
