"""The run lock on an object store is a lease (kiln/engine/checkpoint/lease.py), on each store with
conditional writes, a real API over HTTP reached through the client users run (tests/checkpoint/stores.py:
S3 through s3fs, GCS through gcsfs): the holder keeps renewing it, a lock left unrenewed by a run on
another host is taken over naming that run, two runs racing for an expired lock cannot both win, and a
run whose lease was taken over stops writing on the store, in one sentence, leaving the new holder's
checkpoints and lock alone. Clocks are injected: no test sleeps more than a second."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from kiln.engine.checkpoint.in_use import LOCK, OutputDirInUse
from kiln.engine.checkpoint.lease import Lease
from kiln.engine.checkpoint.remote import RemoteCheckpoints
from tests.checkpoint.lease_fixtures import bucket, holder_of, options, plant, rival, scheme, url  # noqa: F401 (fixtures)


def test_an_unrenewed_lock_of_another_host_is_taken_over_naming_it_and_a_renewed_one_is_not(options, url, caplog):
    now = 1_000_000.0
    store = RemoteCheckpoints(url, options, clock=lambda: now)
    plant(store, renewed=now - 10)  # renewed 10 s ago, lease 300 s: alive
    with pytest.raises(
        OutputDirInUse,
        match=r"is in use by another kiln run \(pid 4242 on node-7, lock renewed 10 s ago\); wait for it to finish, "
        r"or, if it died, for its lock to expire 300 s after its last renewal\.$",
    ):
        store.acquire_lock()
    assert holder_of(store)["token"] == "x"  # untouched
    plant(store, renewed=now - 301)  # its lease ran out a second ago
    with caplog.at_level("WARNING", logger="kiln.engine.checkpoint.lease"):
        store.acquire_lock()
    try:
        assert re.search(
            rf"Took over the run lock of {url} from pid 4242 on node-7, whose lease ran out \(last renewed 301 s "
            r"ago, lease 300 s\)",
            caplog.text,
        )
        mine = holder_of(store)
        assert mine["pid"] == os.getpid() and mine["renewed"] == now and mine["lease"] == 300.0
    finally:
        store.release_lock()
    assert not store.fs.exists(f"{store.root}/{LOCK}")


def test_a_lock_without_a_renewed_time_is_judged_by_the_stores_time_of_its_last_write(options, url, caplog):
    """A lock of another kind (an older kiln's, a hand-made one) has no `renewed`: the store's own time
    of its last write stands for it (S3's LastModified, GCS's updated)."""
    store = RemoteCheckpoints(url, options)
    store.fs.pipe_file(f"{store.root}/{LOCK}", json.dumps({"pid": 4242, "host": "node-7"}).encode())
    with pytest.raises(OutputDirInUse, match=r"\(pid 4242 on node-7, lock renewed [0-9] s ago\)"):
        rival(store, ahead=0.0).take()
    taker = rival(store, ahead=1000.0)
    with caplog.at_level("WARNING", logger="kiln.engine.checkpoint.lease"):
        taker.take()
    try:
        assert re.search(r"from pid 4242 on node-7, whose lease ran out \(last renewed 10[0-9][0-9] s ago", caplog.text)
    finally:
        taker.release()


def race(store: RemoteCheckpoints) -> tuple[list[Lease], list[object]]:
    """Two runs take the lock at once: each reads the expired lock, waits for the other to have read it
    too, then writes; returns the two and what each got ("won", or its OutputDirInUse)."""
    takers = [rival(store, ahead=0.0) for _ in range(2)]
    both_read = threading.Barrier(2)
    for taker in takers:
        read, first = taker._read, [True]

        def read_then_wait(read=read, first=first):  # type: ignore[no-untyped-def]
            found = read()
            if first[0]:
                first[0] = False
                both_read.wait(timeout=10)
            return found

        taker._read = read_then_wait  # type: ignore[method-assign]
    outcomes: list[object] = [None, None]

    def take(i: int) -> None:
        try:
            takers[i].take()
            outcomes[i] = "won"
        except OutputDirInUse as err:
            outcomes[i] = err

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return takers, outcomes


def test_two_runs_racing_for_an_expired_lock_never_both_win(options, url):
    store = RemoteCheckpoints(url, options)
    for round_ in range(4):
        plant(store, renewed=time.time() - 1000)
        takers, outcomes = race(store)
        winners = [t for t, o in zip(takers, outcomes) if o == "won"]
        assert len(winners) == 1, (round_, outcomes)
        loser = outcomes[1 - takers.index(winners[0])]
        assert isinstance(loser, OutputDirInUse) and f"pid {os.getpid()}" in str(loser)
        assert holder_of(store)["token"] == winners[0].token
        winners[0].release()
        assert not store.fs.exists(f"{store.root}/{LOCK}")


def test_a_lock_renewed_between_the_read_and_the_takeover_is_not_taken(options, url):
    store = RemoteCheckpoints(url, options)
    plant(store, renewed=time.time() - 1000)
    taker = rival(store, ahead=0.0)
    read, reads = taker._read, []

    def read_then_renewed(read=read):  # type: ignore[no-untyped-def]
        found = read()
        if not reads:  # the holder was only slow: it renews right after the taker read its expired lock
            plant(store, renewed=time.time())
        reads.append(found)
        return found

    taker._read = read_then_renewed  # type: ignore[method-assign]
    with pytest.raises(OutputDirInUse, match=r"in use by another kiln run \(pid 4242 on node-7, lock renewed 0 s"):
        taker.take()
    assert holder_of(store)["token"] == "x"
    store.fs.rm_file(f"{store.root}/{LOCK}")


def test_a_dead_process_of_this_host_loses_its_lock_at_once(options, url, caplog):
    import socket
    import subprocess

    store = RemoteCheckpoints(url, options)
    dead = subprocess.Popen(["true"])
    dead.wait()
    plant(store, renewed=time.time())  # renewed just now, by a process on another host: live
    with pytest.raises(OutputDirInUse):
        store.acquire_lock()
    alive = {"pid": os.getppid(), "host": socket.gethostname(), "renewed": time.time(), "lease": 300.0, "token": "z"}
    store.fs.pipe_file(f"{store.root}/{LOCK}", json.dumps(alive).encode())
    with pytest.raises(OutputDirInUse, match=rf"\(pid {os.getppid()} on "):
        store.acquire_lock()  # a live process of this host, within its lease
    info = {"pid": dead.pid, "host": socket.gethostname(), "renewed": time.time(), "lease": 300.0, "token": "y"}
    store.fs.pipe_file(f"{store.root}/{LOCK}", json.dumps(info).encode())
    with caplog.at_level("WARNING", logger="kiln.engine.checkpoint.lease"):
        store.acquire_lock()
    try:
        assert f"from pid {dead.pid} on {socket.gethostname()}, a process on this host that is no longer running" in (
            caplog.text
        )
    finally:
        store.release_lock()


def test_a_create_the_store_took_though_its_answer_was_lost_is_this_runs(options, url):
    """A client that retries a create whose answer was lost meets its own lock (412): the run holds it."""
    store = RemoteCheckpoints(url, options)
    taker = rival(store, ahead=0.0)
    create = taker.store.create  # type: ignore[union-attr]
    taker.store.create = lambda *a: (create(*a), (_ for _ in ()).throw(FileExistsError("412")))[1]  # type: ignore
    taker.take()
    try:
        assert holder_of(store)["token"] == taker.token
        taker.verify()  # the version it adopted is the store's
        taker.renew()
        assert taker.lost is None
    finally:
        taker.release()
    assert not store.fs.exists(f"{store.root}/{LOCK}")


def test_a_takeover_read_back_as_another_runs_is_not_a_win(options, url):
    """On a store whose condition check and write are not one step, another run's write may land right
    after this run's: the read-back sees it, and this run is refused, naming that run."""
    store = RemoteCheckpoints(url, options)
    plant(store, renewed=time.time() - 1000)
    taker = rival(store, ahead=0.0)
    put = taker._put

    def overtaken(*, if_match):  # type: ignore[no-untyped-def]
        etag = put(if_match=if_match)
        if if_match is not None:
            plant(store, renewed=time.time())  # the other run's write, a moment later
        return etag

    taker._put = overtaken  # type: ignore[method-assign]
    with pytest.raises(OutputDirInUse, match=r"\(pid 4242 on node-7, lock renewed 0 s ago\)"):
        taker.take()
    assert taker._beat is None  # it never started renewing
    store.fs.rm_file(f"{store.root}/{LOCK}")


def test_a_run_that_loses_every_race_for_the_lock_gives_up_naming_the_winner(options, url):
    store = RemoteCheckpoints(url, options)
    plant(store, renewed=time.time() - 1000)
    taker = rival(store, ahead=0.0)

    def refused(*, if_match):  # type: ignore[no-untyped-def]
        raise FileExistsError("exists") if if_match is None else OSError("At least one of the pre-conditions")

    taker._put = refused  # type: ignore[method-assign]
    with pytest.raises(
        OutputDirInUse, match=r"another kiln run \(pid 4242 on node-7\), which took its lock at the same time; wait"
    ):
        taker.take()
    store.fs.rm_file(f"{store.root}/{LOCK}")


def test_the_holder_keeps_renewing_its_lease(options, url):
    # Renewed every second. Polled rather than slept: on a loaded machine the heartbeat thread can be late by
    # a fraction of a second, and a test that reads the lock at a fixed instant would fail for that alone.
    store = RemoteCheckpoints(url, options, lease=3.0)
    started = time.monotonic()
    store.acquire_lock()
    try:
        first = holder_of(store)["renewed"]
        for renewals in range(2):  # two renewals: the second writes over the first's version (If-Match)
            deadline = time.monotonic() + 30
            while holder_of(store)["renewed"] == first and time.monotonic() < deadline:
                time.sleep(0.05)
            assert holder_of(store)["renewed"] > first, f"renewal {renewals + 1} never came"
            first = holder_of(store)["renewed"]
        # The run has now held the lock for longer than one lease: a holder that did not renew would have lost it
        time.sleep(max(0.0, started + 3.5 - time.monotonic()))
        with pytest.raises(OutputDirInUse, match="in use by another kiln run"):
            rival(store, ahead=0.0).take()  # alive, however long it runs
    finally:
        store.release_lock()
    assert not store.fs.exists(f"{store.root}/{LOCK}")


def test_a_failed_renewal_keeps_the_lease_and_one_the_store_took_is_adopted(options, url, monkeypatch):
    store = RemoteCheckpoints(url, options)
    store.acquire_lock()
    from kiln.engine.checkpoint.remote import _held

    lease = _held[url]
    try:
        put = lease.store.replace  # type: ignore[union-attr]
        monkeypatch.setattr(lease.store, "replace", lambda *a: (_ for _ in ()).throw(OSError("503 Slow Down")))
        lease.renew()  # the store refused it: still ours
        monkeypatch.setattr(
            lease.store, "replace", lambda *a: (put(*a), (_ for _ in ()).throw(TimeoutError("read")))[1]
        )
        lease.renew()  # written, but the answer was lost: the store's new version is ours
        monkeypatch.setattr(lease.store, "replace", put)
        lease.verify()
        lease.renew()  # conditional on the adopted version
        assert lease.lost is None and holder_of(store)["token"] == lease.token
    finally:
        store.release_lock()
    assert not store.fs.exists(f"{store.root}/{LOCK}")
