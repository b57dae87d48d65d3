"""Checkpoints mirrored to a real S3 API (moto's server over HTTP, through s3fs, the client users run):
the marker goes up last, a failure or a kill in mid-upload leaves the previous checkpoint the newest
intact one, a damaged remote checkpoint is skipped on download, rotation deletes the marker first, and
one run holds a prefix at a time. A URL whose file system is not installed is one sentence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from kiln.engine.checkpoint.in_use import LOCK, OutputDirInUse
from kiln.engine.checkpoint.integrity import MARKER
from kiln.engine.checkpoint.remote import RemoteCheckpoints, UploadFailed, is_remote
from kiln.utils.errors import ConfigError
from tests.checkpoint.lease_fixtures import run_dir  # noqa: F401 (a fixture)
from tests.checkpoint.s3_server import s3_endpoint
from tests.installed import requires

pytestmark = [requires("s3fs", "pip install kiln[s3]"), requires("moto", "pip install moto[server]")]


@pytest.fixture(scope="module")
def s3():  # type: ignore[no-untyped-def]
    with s3_endpoint("kiln-bucket") as options:
        yield options


@pytest.fixture
def store(s3, request):  # type: ignore[no-untyped-def]
    url = f"s3://kiln-bucket/{request.node.name.replace('[', '-').rstrip(']')}"
    return RemoteCheckpoints(url, s3, sleep=lambda s: None)


def local_files(folder: str) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
        for d, _, fs in os.walk(folder)
        for f in fs
    }


def test_upload_puts_the_marker_last_and_download_brings_back_every_byte(store, run_dir, tmp_path, monkeypatch):
    order: list[str] = []
    put = store.fs.put_file
    monkeypatch.setattr(
        store.fs, "put_file", lambda src, dst, **kw: (order.append(os.path.basename(dst)), put(src, dst, **kw))[1]
    )
    for step in (5, 10):
        assert store.upload(os.path.join(run_dir, f"checkpoint-{step}")) == f"{store.url}/checkpoint-{step}"
    assert order[-1] == MARKER and order.count(MARKER) == 2 and order.index(MARKER) == len(order) // 2 - 1
    assert store.steps() == [(5, "checkpoint-5"), (10, "checkpoint-10")]
    path = store.download_newest(str(tmp_path / "cache"))
    assert path == str(tmp_path / "cache" / "checkpoint-10")
    assert local_files(path) == local_files(os.path.join(run_dir, "checkpoint-10"))


def test_a_failure_past_the_retries_leaves_the_previous_checkpoint_newest(store, run_dir, tmp_path, monkeypatch):
    store.upload(os.path.join(run_dir, "checkpoint-5"))
    put, calls = store.fs.put_file, []

    def flaky(src, dst, **kw):  # type: ignore[no-untyped-def]
        calls.append(dst)
        if len(calls) > 2:  # the third file of checkpoint-10 never gets through
            raise ConnectionError("connection reset by peer")
        return put(src, dst, **kw)

    monkeypatch.setattr(store.fs, "put_file", flaky)  # the file system object is fsspec's cached instance
    with pytest.raises(
        UploadFailed,
        match=r"failed after 5 tries \(ConnectionError: connection reset by peer\); the "
        "store's earlier checkpoints are untouched",
    ):
        store.upload(os.path.join(run_dir, "checkpoint-10"))
    assert len(calls) == 2 + 5 and not any(c.endswith(MARKER) for c in calls)
    assert store.steps() == [(5, "checkpoint-5")]
    assert store.download_newest(str(tmp_path / "cache")).endswith("checkpoint-5")


def test_a_transient_failure_is_retried_with_backoff(s3, run_dir, monkeypatch):
    sleeps: list[float] = []
    store = RemoteCheckpoints("s3://kiln-bucket/transient", s3, sleep=sleeps.append, backoff=0.25)
    put, failures = store.fs.put_file, [OSError("503 Slow Down")] * 2
    monkeypatch.setattr(
        store.fs,
        "put_file",
        lambda src, dst, **kw: (_ for _ in ()).throw(failures.pop()) if failures else put(src, dst, **kw),
    )
    store.upload(os.path.join(run_dir, "checkpoint-5"))
    assert sleeps == [0.25, 0.5] and store.steps() == [(5, "checkpoint-5")]


def test_a_damaged_remote_checkpoint_is_skipped_for_the_previous_one(store, run_dir, tmp_path):
    for step in (5, 10):
        store.upload(os.path.join(run_dir, f"checkpoint-{step}"))
    weights = next(f for f in local_files(os.path.join(run_dir, "checkpoint-10")) if f.endswith(".safetensors"))
    remote = f"{store.root}/checkpoint-10/{weights}"
    data = bytearray(store.fs.cat_file(remote))
    data[-1] ^= 0xFF  # same size: only the digest can tell
    store.fs.pipe_file(remote, bytes(data))
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint s3://kiln-bucket/.*/checkpoint-10"):
        path = store.download_newest(str(tmp_path / "cache"))
    assert path.endswith("checkpoint-5") and not os.path.exists(str(tmp_path / "cache" / "checkpoint-10"))


def test_rotation_deletes_the_marker_before_the_files(store, run_dir, monkeypatch):
    store.upload(os.path.join(run_dir, "checkpoint-5"))
    removed: list[str] = []
    rm_file, rm = store.fs.rm_file, store.fs.rm
    monkeypatch.setattr(store.fs, "rm_file", lambda p, **kw: (removed.append(os.path.basename(p)), rm_file(p, **kw))[1])
    monkeypatch.setattr(store.fs, "rm", lambda p, **kw: (removed.append("folder"), rm(p, **kw))[1])
    store.delete("checkpoint-5")
    assert removed == [MARKER, "folder"] and store.steps() == []
    assert not store.fs.exists(f"{store.root}/checkpoint-5")


def test_one_run_holds_a_prefix_at_a_time(store):
    lock = f"{store.root}/{LOCK}"
    store.acquire_lock()
    store.acquire_lock()  # re-entrant in the process that holds it (kiln fit holds it around fit's own hold)
    store.release_lock()
    assert store.fs.exists(lock)
    store.release_lock()
    assert not store.fs.exists(lock)
    store.fs.pipe_file(lock, json.dumps({"pid": 4242, "host": "node-7"}).encode())
    with pytest.raises(
        OutputDirInUse, match=r"is in use by another kiln run \(pid 4242 on node-7, lock renewed \d+ s ago\); wait"
    ):
        store.acquire_lock()  # a holder on another host, within its lease (test_remote_lease.py): refused
    store.fs.rm_file(lock)
    store.acquire_lock()  # free again
    store.release_lock()


def test_a_store_without_conditional_writes_gets_a_lock_without_a_lease(monkeypatch, caplog):
    import socket
    import subprocess

    store = RemoteCheckpoints("memory://kiln/run")
    lock = f"{store.root}/{LOCK}"
    store.acquire_lock()
    assert json.loads(store.fs.cat_file(lock))["pid"] == os.getpid()
    store.release_lock()
    assert not store.fs.exists(lock)
    store.fs.pipe_file(lock, json.dumps({"pid": 4242, "host": "node-7", "renewed": 0.0}).encode())
    with pytest.raises(
        OutputDirInUse,
        match=r"in use by another kiln run \(pid 4242 on node-7\); wait for it to finish, or delete "
        r"\.kiln-run\.lock there if that run is dead \(this store has no conditional writes",
    ):
        store.acquire_lock()  # renewed long ago, but nothing renews on this store: refused
    dead = subprocess.Popen(["true"])
    dead.wait()
    store.fs.pipe_file(lock, json.dumps({"pid": dead.pid, "host": socket.gethostname()}).encode())
    with caplog.at_level("WARNING", logger="kiln.engine.checkpoint.lease"):
        store.acquire_lock()
    assert "no longer running" in caplog.text
    store.release_lock()
    assert not store.fs.exists(lock)
    monkeypatch.setattr(
        store.fs, "open", lambda path, mode="rb", **kw: (_ for _ in ()).throw(NotImplementedError(mode))
    )
    with pytest.raises(ConfigError, match=r"is on a store that cannot create a file exclusively \(xb\), so two runs"):
        store.acquire_lock()


UPLOADER = """
import sys, time
from kiln.engine.checkpoint.remote import RemoteCheckpoints
store = RemoteCheckpoints(sys.argv[1], {"key": "testing", "secret": "testing",
                                        "client_kwargs": {"endpoint_url": sys.argv[2], "region_name": "eu-west-1"}})
put = store.fs.put_file
def slow(src, dst, **kw):
    put(src, dst, **kw)
    print("put", dst, flush=True)
    time.sleep(30)  # killed here, after the first file
store.fs.put_file = slow
store.upload(sys.argv[3])
"""


def test_a_kill_in_mid_upload_leaves_the_previous_checkpoint_newest(store, s3, run_dir, tmp_path):
    store.upload(os.path.join(run_dir, "checkpoint-5"))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            UPLOADER,
            store.url,
            s3["client_kwargs"]["endpoint_url"],
            os.path.join(run_dir, "checkpoint-10"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert child.stdout.readline().startswith("put ")  # the first file of checkpoint-10 is on the store
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert store.fs.exists(f"{store.root}/checkpoint-10")  # partly there ...
    assert store.steps() == [(5, "checkpoint-5")]  # ... and not taken for a checkpoint
    assert store.download_newest(str(tmp_path / "cache")).endswith("checkpoint-5")


def test_urls_and_a_missing_file_system(monkeypatch):
    assert is_remote("s3://b/x") and is_remote("memory://x") and not is_remote("/tmp/x") and not is_remote("file:///x")
    import fsspec

    def missing(url, **kw):  # type: ignore[no-untyped-def]
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(
        ConfigError,
        match=r"gs://b/run is on a gs:// store, whose file system is not installed; "
        r"pip install kiln\[gcs\]",
    ):
        RemoteCheckpoints("gs://b/run")


def test_a_checkpoint_downloaded_before_is_reused_unless_damaged(store, run_dir, tmp_path, monkeypatch):
    store.upload(os.path.join(run_dir, "checkpoint-5"))
    gets: list[str] = []
    get = store.fs.get
    monkeypatch.setattr(store.fs, "get", lambda src, dst, **kw: (gets.append(src), get(src, dst, **kw))[1])
    path = store.download_newest(str(tmp_path / "cache"))
    assert store.download_newest(str(tmp_path / "cache")) == path and len(gets) == 1  # intact: not fetched again
    weights = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    with open(os.path.join(path, weights), "r+b") as f:  # the local copy rots: same size, other bytes
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert store.download_newest(str(tmp_path / "cache")) == path and len(gets) == 2
    assert local_files(path) == local_files(os.path.join(run_dir, "checkpoint-5"))
