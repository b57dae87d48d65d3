"""A run whose lease on the store was taken over (kiln/engine/checkpoint/lease.py) stops writing there, in
one sentence (LeaseLost), on every rank, and leaves the new holder's checkpoints and lock alone: between a
checkpoint's files and its marker, at its next save, and at the end of fit. On each store with conditional
writes (tests/checkpoint/lease_fixtures.py)."""

from __future__ import annotations

import json
import os

import pytest

from kiln.engine.checkpoint import remote_run
from kiln.engine.checkpoint.in_use import LOCK
from kiln.engine.checkpoint.integrity import MARKER
from kiln.engine.checkpoint.lease import Lease, LeaseLost
from kiln.engine.checkpoint.remote import RemoteCheckpoints
from tests.checkpoint.checkpoint_helpers import train
from tests.checkpoint.lease_fixtures import bucket, holder_of, options, rival, run_dir, scheme, url  # noqa: F401 (fixtures)
from tests.checkpoint.store_world import endpoint_of


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
        endpoint_of(options),  # the workers reach the same server (store_world.py)
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
