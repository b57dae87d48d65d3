"""The run lock of an object store, as a lease: one run per store prefix, and a run that died on any host
strands nothing.

A store cannot tell a live holder from a dead one, so the holder says it is alive: the lock file
(`.kiln-run.lock`) records its `renewed` time and its lease length, and a heartbeat thread rewrites it
every lease/3 seconds. A lock not renewed for longer than its lease is taken over, with a warning naming
the old holder; so is one left by a dead process on this host, at once.

Every write of the lock is conditional (conditions.py: S3's `If-None-Match: *` and `If-Match` an ETag,
GCS's `ifGenerationMatch`), so that two runs never both believe they hold it:

- taking a free lock is an exclusive create;
- taking over an expired one replaces it only if it is still the version that was read (its version is
  read before its content), then reads it back: of two runs racing for it, one wins and the other is
  refused naming the winner;
- a renewal replaces it only if it is still this run's last write; when it is not, another run took the
  lease over. This run then stops: its next upload, deletion or rotation on the store fails with one
  sentence (LeaseLost) and never writes over the new holder's checkpoints; the release leaves the new
  holder's lock alone (a conditional delete).

The store checks each condition. Every write on the store is preceded by a check that the lock is still
this run's (`verify`), so a run that lost its lease (its heartbeat stalled, say, for a whole lease) stops
before it writes. The hosts' clocks must agree to well within a lease (NTP does).

The conditions are S3's (s3fs) and GCS's (gcsfs). On a store kiln cannot ask for them (`memory://`, ...)
the lock is an exclusive create without a lease, as a store cannot tell a live holder from a dead one:
taken over only from a dead process on this host, and otherwise refused naming the file to delete; a
store that cannot even create a file exclusively is refused in one sentence.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kiln.engine.checkpoint.conditions import conditions_for
from kiln.engine.checkpoint.in_use import OutputDirInUse
from kiln.utils.errors import CheckpointError, ConfigError

__all__ = ["LEASE_SECONDS", "Lease", "LeaseLost"]

log = logging.getLogger(__name__)

#: how long a run lock on a store lives without a renewal (the holder renews it every third of this)
LEASE_SECONDS = 300.0


_DEAD_HERE = "a process on this host that is no longer running (it crashed or was killed)"


class LeaseLost(CheckpointError):
    """Another run took this run's lock on the store over; this run must not write there again."""


def holder_text(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}" if holder else "another process"


class Lease:
    """This process's hold on the run lock at `path` of file system `fs` (the store at `url`)."""

    def __init__(
        self, fs: Any, path: str, url: str, seconds: float = LEASE_SECONDS, clock: Callable[[], float] = time.time
    ) -> None:
        self.fs, self.path, self.url, self.seconds, self.clock = fs, path, url, seconds, clock
        self.store = conditions_for(fs)  # None: a store without conditional writes gets a lock without a lease
        self.renews = self.store is not None
        self.token = uuid.uuid4().hex  # tells this hold from any other, even of the same pid
        self.started = clock()
        self.version: str | None = None  # the lock file as this run last wrote it (an ETag, a generation)
        self.lost: str | None = None  # the sentence of LeaseLost, once another run holds the lock
        self.holds = 1  # nested holders in this process (kiln fit holds it around fit's own hold)
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- the store's conditional writes --------------------------------------------------------
    def _content(self) -> bytes:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started,
            "renewed": self.clock(),
            "lease": self.seconds,
            "token": self.token,
        }
        return json.dumps(info).encode("utf-8")

    def _put(self, *, if_match: str | None) -> str:
        """Write the lock: exclusively (if_match None) or over the version `if_match`; returns its version.
        FileExistsError, FileNotFoundError or OSError when the store refuses the condition."""
        if if_match is None:
            return self.store.create(self.path, self._content())  # type: ignore[union-attr]
        return self.store.replace(self.path, self._content(), if_match)  # type: ignore[union-attr]

    def _read(self) -> tuple[str, dict[str, Any]] | None:
        """The lock's version and what it says of its holder, or None when there is none. The version is
        read first: a write in between makes the content newer than the version, never older, so a renewal
        read as its predecessor can only make a taker wait, never take a live lock."""
        self.fs.invalidate_cache(self.path)
        try:
            info = self.fs.info(self.path)
            raw = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        holder = holder if isinstance(holder, dict) else {}
        if not isinstance(holder.get("renewed"), (int, float)):  # a lock of another kind: the store's time
            modified = info.get("LastModified") or info.get("mtime")  # s3fs's, gcsfs's
            holder["renewed"] = modified.timestamp() if hasattr(modified, "timestamp") else self.clock()
        return (self.store.version(info) if self.store is not None else ""), holder

    # -- taking, keeping and giving back -------------------------------------------------------
    def take(self) -> None:
        """Take the lock (a free one, an expired one, or a dead local process's), then keep it renewed;
        OutputDirInUse names a live holder, or the run that won a race for it."""
        if not self.renews:
            return self._take_without_lease()
        for _ in range(3):
            try:
                self.version = self._put(if_match=None)
                break
            except FileExistsError:
                pass
            found = self._read()
            if found is None:  # released in between: create it again
                continue
            version, holder = found
            if holder.get("token") == self.token:  # this run's own create, taken though its answer was lost
                self.version = version
                break
            why = self._expired(holder)
            if why is None:
                raise OutputDirInUse(
                    f"output_dir {self.url!r} is in use by another kiln run ({holder_text(holder)}, lock renewed "
                    f"{max(0.0, self.clock() - holder['renewed']):.0f} s ago); wait for it to finish, or, if it "
                    f"died, for its lock to expire {_lease_of(holder, self.seconds):.0f} s after its last renewal."
                )
            try:
                self._put(if_match=version)
            except OSError:  # renewed, released or taken in between: look again
                continue
            now = self._read()
            if now is not None and now[1].get("token") == self.token:
                log.warning("Took over the run lock of %s from %s, %s.", self.url, holder_text(holder), why)
                self.version = now[0]
                break
        else:
            found = self._read()
            raise OutputDirInUse(
                f"output_dir {self.url!r} is in use by another kiln run "
                f"({holder_text(found[1] if found else {})}), which took its lock at the same time; wait for it "
                "to finish."
            )
        self._beat = threading.Thread(target=self._heartbeat, name="kiln-run-lock-lease", daemon=True)
        self._beat.start()

    def _take_without_lease(self) -> None:
        """On a store kiln cannot ask for conditional writes: an exclusive create, and no lease. A lock of a
        dead process on this host is taken over; any other is refused, naming the file to delete."""
        for attempt in range(2):
            try:
                with self.fs.open(self.path, "xb") as fh:
                    fh.write(self._content())
                return
            except FileExistsError:
                found = self._read()
                holder = found[1] if found is not None else {}
                if attempt == 0 and _dead_here(holder):
                    log.warning("Took over the run lock of %s from %s, %s.", self.url, holder_text(holder), _DEAD_HERE)
                    self.fs.rm_file(self.path)
                    continue
                raise OutputDirInUse(
                    f"output_dir {self.url!r} is in use by another kiln run ({holder_text(holder)}); wait for it to "
                    f"finish, or delete {self.path.rsplit('/', 1)[-1]} there if that run is dead (this store has no "
                    "conditional writes, so its run lock has no lease that expires)."
                ) from None
            except (NotImplementedError, ValueError) as err:
                raise ConfigError(
                    f"{self.url} is on a store that cannot create a file exclusively ({err}), so two runs could write "
                    "the same checkpoints; use an S3 or GCS bucket, or a local output_dir."
                ) from None

    def _expired(self, holder: dict[str, Any]) -> str | None:
        """Why the lock of `holder` may be taken over (its lease ran out, or it is a dead process of this
        host), or None: it is live."""
        age = self.clock() - holder["renewed"]
        if age > _lease_of(holder, self.seconds):
            return f"whose lease ran out (last renewed {age:.0f} s ago, lease {_lease_of(holder, self.seconds):.0f} s)"
        if _dead_here(holder):
            return _DEAD_HERE
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            self.renew()
            if self.lost is not None:
                return

    def renew(self) -> None:
        """Rewrite the lock's `renewed` time, if it is still this run's; else mark the lease lost."""
        with self._mutex:
            if self.lost is not None or self.version is None:
                return
            try:
                self.version = self._put(if_match=self.version)
                return
            except Exception as err:  # the stores' clients raise their own types (botocore, aiohttp, OSError)
                failure = err
            self._recheck(f"renewing it failed ({type(failure).__name__}: {failure})")

    def _recheck(self, what: str) -> None:
        """The lock is not the version this run last wrote: whose is it? (Called under the mutex.)"""
        try:
            found = self._read()
        except Exception as err:  # the store is unreachable: the next renewal tries again
            log.warning("The run lock of %s could not be read (%s: %s); %s.", self.url, type(err).__name__, err, what)
            return
        if found is not None and found[1].get("token") == self.token:
            self.version = found[0]  # this run's own write, which the store took though the answer was lost
            return
        who = holder_text(found[1]) if found is not None else "nobody: it was deleted"
        self.lost = (
            f"The run lock of {self.url} was taken over by another run ({who}) after this run's lease of "
            f"{self.seconds:.0f} s went unrenewed, so this run stops writing there to leave that run's checkpoints "
            "alone; give each run its own output_dir, or keep the store reachable within the lease."
        )
        log.error("%s", self.lost)

    def verify(self) -> None:
        """Raise LeaseLost unless the lock on the store is still this run's (one HEAD request); called
        before every write on the store."""
        if not self.renews:
            return
        with self._mutex:
            if self.lost is None:
                self.fs.invalidate_cache(self.path)
                try:
                    version: str | None = self.store.version(self.fs.info(self.path))  # type: ignore[union-attr]
                except FileNotFoundError:
                    version = None
                if version != self.version:
                    self._recheck("checking it before a write")
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        """Stop renewing and delete the lock, if it is still this run's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with self._mutex:
            if not self.renews:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.path)
                return
            if self.lost is not None or self.version is None:
                return
            try:
                self.store.delete(self.path, self.version)  # type: ignore[union-attr]
            except Exception as err:  # the stores' clients raise their own types (botocore, aiohttp, OSError)
                log.warning(
                    "The run lock of %s was not deleted (%s: %s); it expires %.0f s after its last renewal.",
                    self.url,
                    type(err).__name__,
                    err,
                    self.seconds,
                )


def _lease_of(holder: dict[str, Any], default: float) -> float:
    lease = holder.get("lease")
    return float(lease) if isinstance(lease, (int, float)) and lease > 0 else default


def _dead_here(holder: dict[str, Any]) -> bool:
    """Whether the lock's holder was a process on this host that is no longer running."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
