"""A run whose output_dir is an S3 URL (moto's server over HTTP, through s3fs, the client users run):
checkpoints are staged locally and uploaded, rotation works on the store, a second machine resumes from
the store bitwise (on a gs:// URL too: tests/checkpoint/gcs_server.py, through gcsfs), an upload failure is a warning that leaves the previous checkpoint the newest intact
one, the run lock takes its remote form, the final model goes up too, `kiln convert` and evaluate read a
checkpoint URL, and credentials in save.storage_options never reach a saved config."""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch

from kiln.config import load_config
from kiln.engine.checkpoint import remote_run
from kiln.engine.checkpoint.in_use import LOCK, OutputDirInUse
from kiln.engine.checkpoint.integrity import MARKER
from kiln.engine.checkpoint.remote import RemoteCheckpoints
from kiln.utils.errors import ConfigError, KilnError
from tests.checkpoint.checkpoint_helpers import train, weights
from tests.checkpoint.s3_server import s3_endpoint
from tests.checkpoint.stores import STORES, store_endpoint
from tests.installed import requires

pytestmark = [requires("s3fs", "pip install kiln[s3]"), requires("moto", "pip install moto[server]")]


BUCKET = "kiln-runs"
CFG = {"max_steps": 20, "save_steps": 5}


@pytest.fixture(scope="module")
def s3():  # type: ignore[no-untyped-def]
    with s3_endpoint(BUCKET, key="AKIAKILNTESTKEY", secret="kiln-test-secret-value") as options:
        yield options


@pytest.fixture(scope="module")
def gs():  # type: ignore[no-untyped-def]
    with store_endpoint("gs", BUCKET) as options:
        yield options


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):  # type: ignore[no-untyped-def]
    """The store's retries without their seconds of backoff."""
    monkeypatch.setattr(remote_run, "RemoteCheckpoints", functools.partial(RemoteCheckpoints, sleep=lambda s: None))


def remote(s3, request, name: str = "", scheme: str = "s3") -> str:  # type: ignore[no-untyped-def]
    return f"{scheme}://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}{name}"


def settings(s3, staging, **save):  # type: ignore[no-untyped-def]
    return {**CFG, "save": {"storage_options": s3, "staging_dir": str(staging), "total_limit": 2, **save}}


def store(url: str, s3) -> RemoteCheckpoints:  # type: ignore[no-untyped-def]
    return RemoteCheckpoints(url, s3)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The final weights of the same run, uninterrupted, in a local folder."""
    return weights(train(str(tmp_path_factory.mktemp("straight") / "out"), CFG))


@pytest.mark.parametrize("scheme", STORES)
def test_a_run_on_a_store_rotates_there_and_another_machine_resumes_it_bitwise(
    scheme, request, tmp_path, straight, monkeypatch
):
    s3 = request.getfixturevalue(scheme)  # the storage options of the S3 server or of the GCS one
    url = remote(s3, request, scheme=scheme)
    with pytest.raises(RuntimeError, match="simulated crash after saving step 15"):
        train(url, settings(s3, tmp_path / "machine-a", async_save=True), crash_at=15)  # uploads in the background
    runs = store(url, s3)
    assert runs.steps() == [(10, "checkpoint-10"), (15, "checkpoint-15")]  # save_total_limit=2, on the store
    assert not runs.fs.exists(f"{runs.root}/checkpoint-5")  # rotated away, files and all
    assert not runs.fs.exists(f"{runs.root}/{LOCK}")  # the run lock went with the run
    fetched: list[str] = []
    fetch = RemoteCheckpoints._fetch
    monkeypatch.setattr(
        RemoteCheckpoints, "_fetch", lambda self, name, *a: (fetched.append(name), fetch(self, name, *a))[1]
    )
    resumed = train(url, settings(s3, tmp_path / "machine-b"), model_seed=1234, resume=True)
    assert fetched == ["checkpoint-15"]  # only the newest intact checkpoint came down
    assert resumed.state.global_step == 20
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, straight[name]), name
    assert runs.steps() == [(15, "checkpoint-15"), (20, "checkpoint-20")]
    assert sorted(os.listdir(tmp_path / "machine-b")) == ["checkpoint-15", "checkpoint-20"]


def test_an_upload_failure_is_a_warning_and_the_store_keeps_the_previous_checkpoint(
    s3, request, tmp_path, straight, monkeypatch
):
    url = remote(s3, request)
    import s3fs

    fs = s3fs.S3FileSystem(**s3)  # fsspec's cached instance: the one the run uploads through
    put = fs.put_file

    def down_from_step_10(src: str, dst: str, **kw: object) -> None:  # the store goes away mid-run
        if "/checkpoint-5/" not in dst:
            raise ConnectionError("connection reset by peer")
        put(src, dst, **kw)

    monkeypatch.setattr(fs, "put_file", down_from_step_10)
    with pytest.warns(UserWarning) as caught:
        first = train(url, settings(s3, tmp_path / "machine-a"))
    failed = [str(w.message) for w in caught if "not uploaded" in str(w.message)]
    assert len(failed) == 3 and re.match(
        rf"checkpoint-10 was saved in .*machine-a but not uploaded to {url}: Uploading .* of checkpoint-10 to "
        rf"{url} failed after 5 tries \(ConnectionError: connection reset by peer\).*The store's newest intact "
        "checkpoint is checkpoint-5; training goes on",
        failed[0],
    )
    assert first.state.global_step == 20  # the run went on to its end
    assert os.path.isfile(tmp_path / "machine-a" / "checkpoint-20" / MARKER)  # kept locally
    runs = store(url, s3)
    assert runs.steps() == [(5, "checkpoint-5")] and not runs.fs.exists(f"{runs.root}/checkpoint-10/{MARKER}")
    monkeypatch.setattr(fs, "put_file", put)
    resumed = train(url, settings(s3, tmp_path / "machine-b"), model_seed=1234, resume=True)
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, straight[name]), name


def test_one_run_per_url_and_a_finished_one_is_never_overwritten(s3, request, tmp_path, caplog, monkeypatch):
    from kiln.engine.checkpoint.output_dir import run_lock

    url = remote(s3, request)
    runs = store(url, s3)
    runs.fs.pipe_file(f"{runs.root}/{LOCK}", json.dumps({"pid": 4242, "host": "node-7"}).encode())
    with pytest.raises(
        OutputDirInUse, match=rf"output_dir '{url}' is in use by another kiln run \(pid 4242 on node-7, lock renewed"
    ):
        train(url, settings(s3, tmp_path / "a", **{"strategy": "no"}))
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    runs.fs.pipe_file(f"{runs.root}/{LOCK}", json.dumps({"pid": dead.pid, "host": socket.gethostname()}).encode())
    with caplog.at_level("WARNING", logger="kiln.engine.checkpoint.remote"):
        trainer = train(url, {**settings(s3, tmp_path / "b"), "max_steps": 5})  # a killed run's lock: taken over
    assert "no longer running" in caplog.text
    import s3fs

    fs = s3fs.S3FileSystem(**s3)  # fsspec's cached instance: the one the run uploads through
    put, sent = fs.put_file, []
    monkeypatch.setattr(
        fs, "put_file", lambda src, dst, **kw: (sent.append(dst.rsplit("/", 1)[-1]), put(src, dst, **kw))
    )
    with run_lock(trainer.config, trainer.strategy):  # as kiln fit exports: under the run lock, local and remote
        trainer.save_model()
        trainer.save_state()
    assert {"model.safetensors", "trainer_state.json", "kiln_config.yaml"} <= set(sent)  # the final outputs went up
    assert LOCK not in sent and not runs.fs.exists(f"{runs.root}/{LOCK}")  # never the local lock over the store's
    with pytest.raises(KilnError, match=rf"output_dir '{url}' already holds checkpoints .*\(checkpoint-5, "):
        train(url, settings(s3, tmp_path / "c"))  # a fresh machine: the store is what counts


def test_convert_and_evaluate_read_a_checkpoint_url(s3, request, tmp_path, monkeypatch):
    import fsspec

    from kiln.cli import _pick_weights, main

    url = remote(s3, request)
    local = train(str(tmp_path / "local"), {"max_steps": 5})
    RemoteCheckpoints(url, s3).upload(str(tmp_path / "local" / "checkpoint-5"))
    monkeypatch.setitem(fsspec.config.conf, "s3", s3)  # kiln convert: the store's own configuration
    assert main(["convert", f"{url}/checkpoint-5", str(tmp_path / "converted")]) == 0
    from safetensors.torch import load_file

    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert converted.keys() == weights(local).keys()
    assert all(torch.equal(converted[k], v) for k, v in weights(local).items())
    monkeypatch.delitem(fsspec.config.conf, "s3")
    cfg = load_config({"output_dir": str(tmp_path / "eval"), "save": {"storage_options": s3}})
    chosen = _pick_weights(cfg, f"{url}/checkpoint-5", False)
    assert chosen.step == 5 and os.path.isfile(os.path.join(chosen.path, MARKER))
    with pytest.raises(KilnError, match=rf"{url}/checkpoint-9 is not a complete checkpoint on the store"):
        _pick_weights(cfg, f"{url}/checkpoint-9", False)
    run = load_config({"output_dir": url, "save": {"storage_options": s3, "staging_dir": str(tmp_path / "fresh")}})
    found = _pick_weights(run, None, False)  # the run's own weights: nothing local, so the store's newest
    assert found.path == str(tmp_path / "fresh" / "checkpoint-5") and found.step == 5


def test_storage_credentials_never_reach_a_saved_config_and_a_missing_store_is_one_sentence(
    s3, request, tmp_path, monkeypatch
):
    url = remote(s3, request)
    train(url, {**settings(s3, tmp_path / "a"), "max_steps": 5})
    runs = store(url, s3)
    saved = runs.fs.cat_file(f"{runs.root}/checkpoint-5/config.yaml").decode()
    assert s3["secret"] not in saved and s3["key"] not in saved and "<hidden>" in saved
    assert s3["client_kwargs"]["endpoint_url"] in saved and f"remote_dir: {url}" in saved
    import fsspec

    def missing(scheme: str) -> None:
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(
        ConfigError,
        match=r"^output_dir gs://b/run is on a gs:// store, whose file system is not installed; pip install kiln\[gcs\]\.$",
    ):
        load_config({"output_dir": "gs://b/run"})


def test_a_failed_rotation_or_final_upload_is_a_warning_too(tmp_path):
    from types import SimpleNamespace

    from kiln.engine.checkpoint.remote import UploadFailed

    uploads: list[str] = []

    def refuse(*args: object) -> None:
        raise OSError("503 Slow Down")

    def cut(folder: str) -> None:
        raise UploadFailed("Uploading model.safetensors to s3://b/run failed after 5 tries (OSError: 503 Slow Down)")

    fake = SimpleNamespace(url="s3://b/run", uploaded=None, upload=uploads.append, rotate=refuse, upload_files=cut)
    with pytest.warns(
        UserWarning, match=r"Rotating the checkpoints on s3://b/run failed \(OSError: 503 Slow Down\); it keeps"
    ):
        remote_run.publish(fake, str(tmp_path / "checkpoint-4"), 2, None)  # type: ignore[arg-type]
    assert uploads == [str(tmp_path / "checkpoint-4")]
    with pytest.warns(UserWarning, match=rf"^The run's final files stay in {tmp_path}: Uploading model.safetensors"):
        remote_run.upload_outputs(fake, str(tmp_path))  # type: ignore[arg-type]


def test_a_checkpoint_its_run_died_before_uploading_goes_up_at_the_resume_unless_damaged(
    s3, request, tmp_path, straight, monkeypatch
):
    """A run killed between writing checkpoint-15 and uploading it leaves it in its staging folder only: a
    resume on that machine uploads it first and resumes from it; a damaged one stays local, with a warning,
    and the resume takes the store's newest."""
    from kiln.engine.checkpoint.manager import CheckpointManager
    from tests.checkpoint.checkpoint_helpers import Crash

    url, staging = remote(s3, request), tmp_path / "machine-a"
    published = remote_run.RunUploads.published

    def killed_before_the_upload_of_15(self, final, best):  # type: ignore[no-untyped-def]
        if final.endswith("checkpoint-15"):
            raise Crash("killed between the write of checkpoint-15 and its upload")
        published(self, final, best)

    loaded: list[str] = []
    load = CheckpointManager.load
    monkeypatch.setattr(CheckpointManager, "load", lambda self, path: (loaded.append(path), load(self, path))[1])
    monkeypatch.setattr(remote_run.RunUploads, "published", killed_before_the_upload_of_15)
    runs = store(url, s3)
    with pytest.raises(Crash):
        train(url, settings(s3, staging))
    assert runs.steps() == [(5, "checkpoint-5"), (10, "checkpoint-10")]  # checkpoint-15 is local only
    shard = staging / "checkpoint-15" / "model.safetensors"
    shard.write_bytes(bytes(b ^ 0xFF if i == 100 else b for i, b in enumerate(shard.read_bytes())))
    with pytest.warns(UserWarning) as caught, pytest.raises(Crash):  # the same kill again, after step 10's resume
        train(url, settings(s3, staging), model_seed=1234, resume=True)
    said = [str(w.message) for w in caught if "not published" in str(w.message)]
    assert len(said) == 1 and re.match(
        rf"checkpoint-15 is newer than the newest checkpoint on {url} but is not published there, as the staging "
        r"folder holds it damaged \(.*model.safetensors.*\), so the run resumes from the store's newest intact "
        r"checkpoint\.$",
        said[0],
    ), said
    assert [os.path.basename(p) for p in loaded] == ["checkpoint-10"]
    assert runs.steps() == [(5, "checkpoint-5"), (10, "checkpoint-10")]
    monkeypatch.setattr(remote_run.RunUploads, "published", published)
    resumed = train(url, settings(s3, staging), model_seed=1234, resume=True)
    assert [os.path.basename(p) for p in loaded] == ["checkpoint-10", "checkpoint-15"]  # uploaded, then resumed
    uploaded_marker = runs.fs.cat_file(f"{runs.root}/checkpoint-15/{MARKER}")
    assert uploaded_marker == (staging / "checkpoint-15" / MARKER).read_bytes()  # as written: not downloaded again
    assert resumed.state.global_step == 20
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, straight[name]), name
    assert runs.steps() == [(15, "checkpoint-15"), (20, "checkpoint-20")]
