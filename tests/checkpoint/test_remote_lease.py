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

from kiln.engine.checkpoint import remote_run
from kiln.engine.checkpoint.in_use import LOCK, OutputDirInUse
from kiln.engine.checkpoint.integrity import MARKER
from kiln.engine.checkpoint.lease import Lease, LeaseLost
from kiln.engine.checkpoint.remote import RemoteCheckpoints
from tests.checkpoint.checkpoint_helpers import train
from tests.checkpoint.stores import STORES, store_endpoint

BUCKET = "kiln-leases"


@pytest.fixture(scope="module", params=STORES)
def scheme(request) -> str:  # type: ignore[no-untyped-def]
    return str(request.param)


@pytest.fixture(scope="module")
def options(scheme):  # type: ignore[no-untyped-def]
    """The storage options of a server of the store, one per module."""
    with store_endpoint(scheme, BUCKET) as found:
        yield found


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A local output_dir with complete checkpoints at steps 5 and 10."""
    out = str(tmp_path_factory.mktemp("local") / "out")
    train(out, {"max_steps": 10, "save_steps": 5})
    return out


@pytest.fixture
def url(request, scheme) -> str:  # type: ignore[no-untyped-def]
    return f"{scheme}://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


def holder_of(store: RemoteCheckpoints) -> dict:  # type: ignore[type-arg]
    store.fs.invalidate_cache()
    return json.loads(store.fs.cat_file(f"{store.root}/{LOCK}"))


def plant(store: RemoteCheckpoints, renewed: float, lease: float = 300.0) -> None:
    """A lock of a run on another host, last renewed at `renewed`."""
    info = {"pid": 4242, "host": "node-7", "started": renewed - 50, "renewed": renewed, "lease": lease, "token": "x"}
    store.fs.pipe_file(f"{store.root}/{LOCK}", json.dumps(info).encode())


def rival(store: RemoteCheckpoints, ahead: float = 1000.0) -> Lease:
    """Another run's hold on the same lock, whose clock says `ahead` seconds later (so it sees the
    current holder's lease run out)."""
    return Lease(store.fs, f"{store.root}/{LOCK}", store.url, clock=lambda: time.time() + ahead)


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


def test_a_holder_whose_lease_was_taken_over_stops_writing_and_leaves_the_new_holders_work(
    options, url, run_dir, monkeypatch
):
    store = RemoteCheckpoints(url, options)
    store.acquire_lock()
    store.upload(os.path.join(run_dir, "checkpoint-5"))
    successor = rival(store)  # the holder's heartbeat stalled (say): another run sees its lease run out
    successor.take()
    from kiln.engine.checkpoint.remote import _held

    lease = _held[url]
    lease.renew()  # the heartbeat's next renewal finds the lock another run's
    assert lease.lost is not None and lease.lost.startswith(f"The run lock of {url} was taken over")
    writes: list[str] = []
    replace = lease.store.replace  # type: ignore[union-attr]
    monkeypatch.setattr(lease.store, "replace", lambda *a: (writes.append(a[0]), replace(*a))[1])
    lease.renew()  # a lost lease is never written again
    monkeypatch.setattr(lease.store, "replace", replace)
    assert writes == []
    sentence = (
        rf"^The run lock of {url} was taken over by another run \(pid {os.getpid()} on .*\) after this run's lease of "
        r"300 s went unrenewed, so this run stops writing there to leave that run's checkpoints alone; give each "
        r"run its own output_dir, or keep the store reachable within the lease\.$"
    )
    try:
        with pytest.raises(LeaseLost, match=sentence):
            store.upload(os.path.join(run_dir, "checkpoint-5"))  # would delete the marker first
        with pytest.raises(LeaseLost, match=sentence):
            store.upload(os.path.join(run_dir, "checkpoint-10"))
        with pytest.raises(LeaseLost, match=sentence):
            store.delete("checkpoint-5")  # rotation
        with pytest.raises(LeaseLost, match=sentence):
            store.upload_files(run_dir)
        with pytest.raises(LeaseLost, match=sentence):  # a checkpoint of several nodes (remote_run)
            store.withdraw("checkpoint-5")
        with pytest.raises(LeaseLost, match=sentence):
            store.upload_some(os.path.join(run_dir, "checkpoint-5"), ["trainer_state.json"])
        with pytest.raises(LeaseLost, match=sentence):
            store.seal("checkpoint-5", b"{}")
        assert store.steps() == [(5, "checkpoint-5")] and store.fs.exists(f"{store.root}/checkpoint-5/{MARKER}")
        store.release_lock()  # the lost holder leaves the new holder's lock alone
        assert holder_of(store)["token"] == successor.token
    finally:
        successor.release()
    assert not store.fs.exists(f"{store.root}/{LOCK}")


def test_a_release_after_a_takeover_it_did_not_notice_leaves_the_new_holders_lock(options, url, caplog):
    """The release's delete is conditional on this run's last write: a lock another run took over in the
    meantime (no renewal or write of this run came in between to notice) is that run's, and stays."""
    store = RemoteCheckpoints(url, options)
    store.acquire_lock()
    successor = rival(store)
    successor.take()
    try:
        with caplog.at_level("WARNING", logger="kiln.engine.checkpoint.lease"):
            store.release_lock()
        assert holder_of(store)["token"] == successor.token
        assert f"The run lock of {url} was not deleted" in caplog.text
    finally:
        successor.release()
    assert not store.fs.exists(f"{store.root}/{LOCK}")


def test_a_lease_lost_between_the_files_and_the_marker_never_writes_the_marker(options, url, run_dir, monkeypatch):
    store = RemoteCheckpoints(url, options)
    store.acquire_lock()
    successor: list[Lease] = []
    put = store.fs.put_file

    files = [f for _, _, fs in os.walk(os.path.join(run_dir, "checkpoint-5")) for f in fs if f != MARKER]
    sent: list[str] = []

    def taken_during_the_upload(src: str, dst: str, **kw: object) -> None:
        put(src, dst, **kw)
        sent.append(dst)
        if len(sent) == len(files):  # after the last file, right before the marker
            successor.append(rival(store))
            successor[0].take()

    monkeypatch.setattr(store.fs, "put_file", taken_during_the_upload)
    try:
        with pytest.raises(LeaseLost, match="was taken over by another run"):
            store.upload(os.path.join(run_dir, "checkpoint-5"))
        assert len(sent) == len(files) and store.steps() == []  # every file, but no marker: not a checkpoint
    finally:
        store.release_lock()
        successor[0].release()


def test_a_run_whose_lease_is_taken_over_fails_at_its_next_save(options, url, tmp_path, monkeypatch):
    from kiln.engine.callbacks.base import Callback

    monkeypatch.setattr(remote_run, "RemoteCheckpoints", RemoteCheckpoints)
    store = RemoteCheckpoints(url, options)
    successor: list[Lease] = []

    class TakeOverAt7(Callback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 7:
                successor.append(rival(store))
                successor[0].take()

    cfg = {"max_steps": 20, "save_steps": 5, "save": {"storage_options": options, "staging_dir": str(tmp_path / "a")}}
    try:
        with pytest.raises(LeaseLost, match=rf"^The run lock of {url} was taken over by another run"):
            train(url, cfg, callbacks=[TakeOverAt7()])
        assert store.steps() == [(5, "checkpoint-5")]  # checkpoint-10 stayed local, never on the store
        assert os.path.isfile(tmp_path / "a" / "checkpoint-10" / MARKER)
        assert holder_of(store)["token"] == successor[0].token  # the failed run left the new holder's lock
    finally:
        for lease in successor:
            lease.release()


@pytest.mark.distributed
@pytest.mark.parametrize("scheme", STORES[:1], indirect=True)  # the world's workers reach S3 (store_world.py)
def test_a_lost_lease_stops_every_rank_of_a_world_with_its_sentence(options, url, tmp_path):
    """Global rank 0 alone uploads; at the save after another run took the lock over, every rank raises
    LeaseLost with rank 0's sentence (tests/checkpoint/remote_lease_worker.py: 2 processes, gloo): where a
    synchronous save's ranks meet at its end, at the next wait of an asynchronous one, and, for the
    final outputs that `kiln fit` uploads after fit (save_model, save_state), at the end of save_model."""
    from tests.world import run_world

    run_world(
        os.path.join(os.path.dirname(__file__), "remote_lease_worker.py"),
        tmp_path,
        url,
        options["client_kwargs"]["endpoint_url"],
        timeout=300,
    )
    for variant in ("sync", "async", "outputs"):
        outcomes = [json.loads((tmp_path / f"{variant}_{rank}.json").read_text()) for rank in (0, 1)]
        assert outcomes[0] == outcomes[1], (variant, outcomes)
        kind, sentence = outcomes[0]
        assert kind == "LeaseLost" and sentence.startswith(f"The run lock of {url}-{variant} was taken over"), variant
        store = RemoteCheckpoints(f"{url}-{variant}", options)
        if variant == "outputs":  # every checkpoint went up; the export did not
            assert store.steps() == [(5, "checkpoint-5")]
            assert not store.fs.exists(f"{store.root}/model.safetensors")
            continue
        steps = store.steps()
        assert steps == [(5, "checkpoint-5")] or (variant == "async" and steps == []), (variant, steps)
        # checkpoint-10 stayed local; async: checkpoint-5's upload, in the background, may still run at step 7
