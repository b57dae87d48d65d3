"""`save.async_save`: the step loop goes on while a checkpoint is written, and the result is the
checkpoint a synchronous save writes, byte for byte: same files, same checksums, same resume."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import threading
import time

import pytest
import torch

from kiln.engine.callbacks.base import Callback
from kiln.engine.checkpoint import manager as manager_module
from kiln.engine.checkpoint.files import MARKER, is_complete, list_checkpoints
from kiln.engine.checkpoint.integrity import ALGORITHM
from kiln.engine.checkpoint.lease import LeaseLost
from kiln.strategies import safetensors_writer
from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import Crash, folders, train, weights

CFG = {"max_steps": 12, "save_steps": 4, "logging_steps": 2, "save_total_limit": 2}


def _same_bytes(a: str, b: str) -> bool:
    """Whether two checkpoint files hold the same bytes. safetensors writes its metadata mapping in hash
    order, which differs between any two saves (synchronous ones too), so its header is compared parsed,
    and so is the marker, without the safetensors files' checksums; everything else bytewise."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        x, y = fa.read(), fb.read()
    if a.endswith(MARKER):
        mx, my = json.loads(x), json.loads(y)
        for marker in (mx, my):
            marker[ALGORITHM] = {k: v for k, v in marker[ALGORITHM].items() if not k.endswith(".safetensors")}
        return mx == my
    if not a.endswith(".safetensors"):
        return x == y
    (nx,), (ny,) = struct.unpack("<Q", x[:8]), struct.unpack("<Q", y[:8])
    return nx == ny and json.loads(x[8 : 8 + nx]) == json.loads(y[8 : 8 + ny]) and x[8 + nx :] == y[8 + ny :]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One config, saved synchronously (the format declines to stage) and asynchronously, each crashed
    right after step 8's save and resumed: the folders at the crash, at the end, and the final weights."""
    base = tmp_path_factory.mktemp("async")
    cfg = {**CFG, "save_total_limit": None, "save": {"async": True}}
    result = {}
    out = str(base / "out")  # one output_dir for both (config.yaml records it), moved aside after each
    for mode in ("sync", "async"):
        with pytest.MonkeyPatch.context() as mp:
            if mode == "sync":
                mp.setattr(FullStateCheckpointIO, "stage", lambda self, **kw: None)
            with pytest.raises(Crash):
                train(out, cfg, crash_at=8)
            snapshot = str(base / f"{mode}-at-crash")
            shutil.copytree(out, snapshot)
            resumed = train(out, cfg, model_seed=99, resume=True)
        os.rename(out, str(base / mode))
        result[mode] = (snapshot, str(base / mode), weights(resumed))
    result["off"] = weights(train(str(base / "off"), {**CFG, "save_total_limit": None}, model_seed=0))  # never stopped
    return result


def test_an_async_checkpoint_is_byte_for_byte_the_synchronous_one(runs):
    (sync_at_crash, sync, _), (async_at_crash, asynchronous, _) = runs["sync"], runs["async"]
    assert {"checkpoint-4", "checkpoint-8"} == folders(async_at_crash)  # complete before on_save's crash
    for a, b in ((sync_at_crash, async_at_crash), (sync, asynchronous)):
        assert folders(a) == folders(b)
        for name in sorted(folders(a)):
            files = sorted(os.listdir(os.path.join(a, name)))
            assert files == sorted(os.listdir(os.path.join(b, name)))
            for file in sorted(files, key=lambda f: f == MARKER):  # the marker last: a differing file is named
                assert _same_bytes(os.path.join(a, name, file), os.path.join(b, name, file)), f"{name}/{file}"


def test_resuming_an_async_checkpoint_ends_like_resuming_the_synchronous_one_and_like_a_run_without_async(runs):
    sync_weights, async_weights, off = runs["sync"][2], runs["async"][2], runs["off"]
    assert off.keys() == async_weights.keys()
    for name in sync_weights:
        assert torch.equal(sync_weights[name], async_weights[name]), name
        assert torch.equal(off[name], async_weights[name]), name


class _Gate:
    """Holds the background write of the weights until released, and records which thread wrote."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.writing = threading.Event()
        self.threads: list[str] = []


@pytest.fixture
def gate(monkeypatch):
    gate = _Gate()
    real = FullStateCheckpointIO.stage

    def stage(self, **kw):  # type: ignore[no-untyped-def]
        write = real(self, **kw)

        def held(directory):  # type: ignore[no-untyped-def]
            gate.threads.append(threading.current_thread().name)
            gate.writing.set()
            assert gate.release.wait(30)
            write(directory)

        return held

    monkeypatch.setattr(FullStateCheckpointIO, "stage", stage)
    return gate


class StepsDuringSave(Callback):
    """Counts steps taken while checkpoint-4's write is held, then lets it go."""

    reads_checkpoint_on_save = False

    def __init__(self, gate: _Gate, out: str) -> None:
        self.gate, self.out, self.steps_while_held = gate, out, []

    def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        if self.gate.writing.is_set() and not self.gate.release.is_set():
            self.steps_while_held.append(state.global_step)
            assert not os.path.exists(os.path.join(self.out, "checkpoint-4"))  # COMPLETE comes last: no folder yet
            if len(self.steps_while_held) == 3:
                self.gate.release.set()


def test_training_goes_on_while_the_checkpoint_is_written_and_the_folder_appears_when_complete(tmp_path, gate):
    out = str(tmp_path / "out")
    steps = StepsDuringSave(gate, out)
    trainer = train(out, {**CFG, "max_steps": 8, "save": {"async": True}}, callbacks=[steps])
    assert steps.steps_while_held == [5, 6, 7]  # three steps ran while checkpoint-4's weights were held
    assert gate.threads and all(name.startswith("kiln-checkpoint-") for name in gate.threads)
    assert folders(out) == {"checkpoint-4", "checkpoint-8"} and all(is_complete(p) for _, p in list_checkpoints(out))
    assert trainer.checkpoints.saved_step == 8


def test_the_next_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    """At most one save in flight: save 8 starts only after save 4 is complete (and rotated)."""
    order = []
    real_publish = manager_module.CheckpointManager._publish

    def publish(self, tmp, final, meta):  # type: ignore[no-untyped-def]
        order.append(("publish", os.path.basename(final), threading.current_thread().name))
        return real_publish(self, tmp, final, meta)

    # when a background write starts, not when save() is called: the call may come while the previous
    # write is still running (a loaded machine), and is then made to wait
    real_start = manager_module.BackgroundSave.start

    def start(self, step, job):  # type: ignore[no-untyped-def]
        order.append(("start", step, self.in_flight))
        return real_start(self, step, job)

    monkeypatch.setattr(manager_module.CheckpointManager, "_publish", publish)
    monkeypatch.setattr(manager_module.BackgroundSave, "start", start)
    train(str(tmp_path / "out"), {**CFG, "save": {"async": True}})
    assert [o[:2] for o in order] == [
        ("start", 4),
        ("publish", "checkpoint-4"),
        ("start", 8),
        ("publish", "checkpoint-8"),
        ("start", 12),
        ("publish", "checkpoint-12"),
    ]
    assert not any(in_flight for kind, _, in_flight in order if kind == "start")
    assert all(thread.startswith("kiln-checkpoint-") for kind, _, thread in order if kind == "publish")


def test_rotation_happens_only_after_the_new_checkpoint_is_complete(tmp_path, monkeypatch):
    seen = []
    real_rotate = manager_module.CheckpointManager.rotate

    def rotate(self, best):  # type: ignore[no-untyped-def]
        seen.append(sorted(name for name in os.listdir(self.config.output_dir) if name.startswith("checkpoint-")))
        return real_rotate(self, best)

    monkeypatch.setattr(manager_module.CheckpointManager, "rotate", rotate)
    out = str(tmp_path / "out")
    train(out, {**CFG, "save": {"async": True}})
    assert seen[-1] == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]  # the new one is in place when rotation runs
    assert folders(out) == {"checkpoint-8", "checkpoint-12"}


def test_a_failed_background_write_is_raised_at_the_next_save_in_one_sentence_and_loses_nothing(tmp_path, monkeypatch):
    """The disk fills while the writer thread writes checkpoint-8's weights (kiln's safetensors writer's
    os.write fails with ENOSPC)."""
    real, failed = os.write, []

    def write(fd, data):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "kiln-checkpoint-8":
            failed.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(safetensors_writer.os, "write", write)
    out = str(tmp_path / "out")
    with pytest.raises(
        CheckpointError,
        match=r"No space left on device \(ENOSPC\) while writing checkpoint-8 in .*; the "
        r"previous checkpoint checkpoint-4 is intact",
    ):
        train(out, {**CFG, "save": {"async": True}})
    assert failed == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["checkpoint-4"] and is_complete(os.path.join(out, "checkpoint-4"))  # no tmp left


def test_a_failure_of_the_last_save_is_raised_by_the_end_of_fit(tmp_path, monkeypatch):
    def stage(self, **kw):  # type: ignore[no-untyped-def]
        def broken(directory):  # type: ignore[no-untyped-def]
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        return broken

    monkeypatch.setattr(FullStateCheckpointIO, "stage", stage)
    out = str(tmp_path / "out")
    with pytest.raises(
        CheckpointError,
        match=r"Input/output error \(EIO\) while writing checkpoint-4 .* no earlier "
        "checkpoint exists",
    ):
        train(out, {**CFG, "max_steps": 4, "save": {"async": True}})
    assert folders(out) == set()


def test_a_format_that_cannot_stage_saves_synchronously_with_one_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(FullStateCheckpointIO, "stage", lambda self, **kw: None)
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="kiln.engine.checkpoint.manager"):
        train(out, {**CFG, "save": {"async": True}})
    said = [r.getMessage() for r in caplog.records if "async_save" in r.getMessage()]
    assert said == [
        "save.async_save: the 'full' checkpoint format cannot be written in the background yet, so its "
        "checkpoints are saved synchronously."
    ]
    assert folders(out) == {"checkpoint-8", "checkpoint-12"}


def test_a_callback_that_reads_the_folder_on_save_finds_it_complete(tmp_path):
    class Reader(Callback):  # reads_checkpoint_on_save stays True: HF's promise holds
        found: list[bool] = []

        def on_save(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            self.found.append(is_complete(os.path.join(config.output_dir, f"checkpoint-{state.global_step}")))

    train(str(tmp_path / "out"), {**CFG, "save": {"async": True}}, callbacks=[Reader()])
    assert Reader.found == [True, True, True]


def test_sigterm_waits_for_the_save_in_flight_before_it_says_saved(tmp_path, monkeypatch):
    """Preemption: the step's checkpoint (written in the background, slowly) is complete before the run
    reports it saved and fit() returns; the one in flight before it too."""
    from kiln.engine.loop.preemption import Preemption
    from tests.checkpoint.test_preemption import SigtermAt

    real = FullStateCheckpointIO.stage

    def slow_stage(self, **kw):  # type: ignore[no-untyped-def]
        write = real(self, **kw)

        def slow(directory):  # type: ignore[no-untyped-def]
            time.sleep(0.3)
            write(directory)

        return slow

    out = str(tmp_path / "out")
    complete_at_stop = []
    real_stop = Preemption.stop
    monkeypatch.setattr(FullStateCheckpointIO, "stage", slow_stage)
    monkeypatch.setattr(
        Preemption,
        "stop",
        lambda self, step: (
            complete_at_stop.append(is_complete(os.path.join(out, f"checkpoint-{step}"))) or real_stop(self, step)
        ),
    )
    trainer = train(out, {**CFG, "save": {"async": True, "on_preemption": True}}, callbacks=[SigtermAt(6)])
    assert trainer.state.global_step == 6 and complete_at_stop == [True]
    assert folders(out) == {"checkpoint-4", "checkpoint-6"}


def test_every_rank_raises_the_writer_s_failure_at_the_same_wait():
    """Only the writer writes in the background; a fake 2-rank world: the other rank learns the failure
    through the all-gather and raises the same sentence, and a rank with nothing to report raises nothing."""
    from types import SimpleNamespace

    from kiln.engine.checkpoint.background import BackgroundSave

    gathered: list[object] = []

    def manager(messages):  # type: ignore[no-untyped-def]
        def all_gather_object(message):  # type: ignore[no-untyped-def]
            gathered.append(message)
            return messages

        strategy = SimpleNamespace(world_size=2, all_gather_object=all_gather_object)
        config = SimpleNamespace(save=SimpleNamespace(async_save=True))
        return SimpleNamespace(
            config=config, strategy=strategy, _background=BackgroundSave(), uploads=SimpleNamespace(pending=None)
        )

    sentence = "No space left on device (ENOSPC) while writing checkpoint-8"
    with pytest.raises(CheckpointError, match=r"^No space left on device \(ENOSPC\) while writing checkpoint-8$"):
        manager_module.CheckpointManager.wait(manager([(False, sentence), None]))  # rank 1: its thread never ran
    assert gathered == [None]
    manager_module.CheckpointManager.wait(manager([None, None]))
    writer = manager([(False, sentence), None])
    writer._background.start(8, lambda: (_ for _ in ()).throw(CheckpointError(sentence)))
    with pytest.raises(CheckpointError, match="ENOSPC"):
        manager_module.CheckpointManager.wait(writer)  # rank 0: raises its own error, after telling the others
    assert gathered[-1] == (False, sentence)
    lost = "The run lock of s3://b/run was taken over by another run (pid 7 on h)."
    with pytest.raises(LeaseLost, match=r"^The run lock of s3://b/run was taken over"):  # its type too
        manager_module.CheckpointManager.wait(manager([(True, lost), None]))
    writer = manager([(True, lost), None])
    writer._background.start(8, lambda: (_ for _ in ()).throw(LeaseLost(lost)))
    with pytest.raises(LeaseLost):
        manager_module.CheckpointManager.wait(writer)
    assert gathered[-1] == (True, lost)


def test_a_step_boundary_uploads_a_nodes_checkpoint_only_once_its_background_write_has_finished():
    """The nodes' upload of an asynchronous save (uploads.pending) waits for a step boundary where every
    rank's write has finished (a min-reduce; one rank here): while the write runs, training goes on."""
    from types import SimpleNamespace

    from kiln.engine.checkpoint.background import BackgroundSave

    release, waits = threading.Event(), []
    background = BackgroundSave()
    background.start(2, release.wait)
    manager = SimpleNamespace(
        uploads=SimpleNamespace(pending=("out/checkpoint-2", None)),
        _background=background,
        strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=lambda tensor, op: tensor),
        wait=lambda: waits.append("uploaded"),
    )
    try:
        manager_module.CheckpointManager.step_end(manager)
        assert waits == []  # still writing: no wait, no upload
    finally:
        release.set()
        background._thread.join()  # type: ignore[union-attr]
    manager_module.CheckpointManager.step_end(manager)
    assert waits == ["uploaded"]
    background.join()


class _CrashAtStep(Callback):
    reads_checkpoint_on_save = False

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            raise Crash(f"training failed at step {self.step}")


def _slowed(monkeypatch, fail: bool = False) -> None:
    """Background writes that take a while (and, with `fail`, then fail with EIO)."""
    real = FullStateCheckpointIO.stage

    def stage(self, **kw):  # type: ignore[no-untyped-def]
        write = real(self, **kw)

        def slow(directory):  # type: ignore[no-untyped-def]
            time.sleep(0.5)
            if fail:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            write(directory)

        return slow

    monkeypatch.setattr(FullStateCheckpointIO, "stage", stage)


def test_a_save_in_flight_when_training_fails_still_lands(tmp_path, monkeypatch):
    _slowed(monkeypatch)
    out = str(tmp_path / "out")
    with pytest.raises(Crash, match="training failed at step 5"):  # the training error, not the save's
        train(out, {**CFG, "save": {"async": True}}, callbacks=[_CrashAtStep(5)])
    assert folders(out) == {"checkpoint-4"} and is_complete(os.path.join(out, "checkpoint-4"))


def test_a_save_that_fails_while_training_fails_is_logged_under_the_training_error(tmp_path, monkeypatch, caplog):
    _slowed(monkeypatch, fail=True)
    out = str(tmp_path / "out")
    with caplog.at_level(logging.ERROR, logger="kiln.engine.checkpoint.manager"):
        with pytest.raises(Crash, match="training failed at step 5"):
            train(out, {**CFG, "save": {"async": True}}, callbacks=[_CrashAtStep(5)])
    said = [r.getMessage() for r in caplog.records if "background save" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        "The background save of checkpoint-4 failed too: Input/output error (EIO)"
    )
    assert folders(out) == set()


def test_a_failed_async_dcp_write_is_raised_as_the_failing_rank_s_own_error():
    """DCP's future fails with its BaseException wrapper of every failing rank's error; the engine gets
    the lowest failing rank's own exception, so an OSError keeps its errno for the one sentence."""
    from concurrent.futures import Future

    from torch.distributed.checkpoint import CheckpointException

    from kiln.strategies.mesh.async_dcp import finished

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    future: Future = Future()
    future.set_exception(CheckpointException("write", {1: (full, None), 3: (ValueError("later rank"), None)}))
    with pytest.raises(OSError) as raised:
        finished(future)
    assert raised.value is full
    interrupted: Future = Future()
    interrupted.set_exception(CheckpointException("write", {2: (KeyboardInterrupt(), None)}))
    with pytest.raises(CheckpointError, match=r"interrupted on rank\(s\) \[2\] \(KeyboardInterrupt\)\.$"):
        finished(interrupted)
    done: Future = Future()
    done.set_result(object())
    finished(done)  # a finished save returns


def test_staging_copies_buffers_at_once_and_a_copy_torn_by_an_in_place_change_is_not_written(tmp_path, monkeypatch):
    """The parameters and optimizer state are copied on a thread (held here by an event); a forward pass
    meanwhile changes BatchNorm's statistics in place, which were copied at the step boundary. A change
    to a parameter before its copy is made fails the write in one sentence, and writes no weights."""
    from torch import nn

    from kiln.strategies.model_weights import load_weights
    from kiln.utils.host_copy import HostStaging

    release = threading.Event()
    real_fill = HostStaging._fill
    monkeypatch.setattr(HostStaging, "_fill", lambda self, d: (release.wait(30), real_fill(self, d)))
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    staging = HostStaging()

    def stage(directory):  # type: ignore[no-untyped-def]
        io = FullStateCheckpointIO()
        kw = {"save_optimizer": True, "safetensors": True, "writer": True, "staging": staging}
        return io.stage(directory=directory, model=model, module=model, optimizer=optimizer, **kw)

    write = stage(str(tmp_path))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 2))  # a train-mode forward: the running statistics change in place
    release.set()
    write(str(tmp_path))
    saved = load_weights(str(tmp_path))
    assert all(torch.equal(saved[k], before[k]) for k in before)
    release.clear()
    torn = tmp_path / "torn"
    torn.mkdir()
    write = stage(str(torn))
    with torch.no_grad():
        model[0].weight.mul_(2)  # no optimizer step: nothing waits for the copy
    release.set()
    with pytest.raises(CheckpointError, match=r"was not written: a tensor of shape \(2, 2\) was changed in place"):
        write(str(torn))
    assert os.listdir(torn) == []
