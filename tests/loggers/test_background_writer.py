"""The loggers' writes run on the background writer, and no record is lost: after a normal end, an
exception mid-run, a SIGTERM (the default action) and a kill followed by a resume, the history files
hold exactly the records the loggers were handed. Writes are slowed down so that records really are
queued behind the writer when the run ends."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from kiln import Callback, Trainer
from kiln.engine.callbacks.loggers import LoggerCallback
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.loggers import writer as writer_module
from kiln.loggers.base import Logger
from kiln.loggers.csv import CSVLogger
from kiln.loggers.jsonl import JSONLLogger
from tests.helpers import TinyRegressor, regression_data
from tests.loggers.conftest import make_config
from tests.loggers.writer_worker import Recorder, run_config, slow_writes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMING = ("_per_second", "_runtime")


def files(out):
    """(csv rows, jsonl rows) of a run, as {name: float} without empty cells."""
    with open(os.path.join(out, "runs", "metrics.csv"), newline="") as fh:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(fh)]
    with open(os.path.join(out, "runs", "metrics.jsonl")) as fh:
        return rows, [json.loads(line) for line in fh]


def without_timing(rows):
    return [{k: v for k, v in row.items() if not k.endswith(TIMING)} for row in rows]


def train(out, *callbacks, resume=None):
    torch.manual_seed(0)  # the same initial weights in every process
    trainer = Trainer(
        TinyRegressor(), run_config(str(out)), train_dataset=regression_data(64), callbacks=list(callbacks)
    )
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def test_normal_end_writes_every_record_and_never_on_the_training_thread(tmp_path, monkeypatch):
    writers: list[str] = []
    for cls in (CSVLogger, JSONLLogger):
        for name in ("log_metrics", "_rewrite"):
            original = getattr(cls, name)

            def spy(self, *args, __original=original):
                writers.append(threading.current_thread().name)
                return __original(self, *args)

            monkeypatch.setattr(cls, name, spy)
    slow_writes(monkeypatch)
    recorder = Recorder()
    trainer = train(tmp_path / "out", recorder)
    assert len(recorder.records) == 7  # steps 2..12 and the final summary
    assert files(tmp_path / "out") == (recorder.records, recorder.records)
    trainer.evaluate(regression_data(8, seed=1))  # on its own: its record is on disk when it returns
    assert len(recorder.records) == 8 and files(tmp_path / "out") == (recorder.records, recorder.records)
    assert writers and set(writers) == {"kiln-log-writer"}, writers


def test_an_exception_mid_run_keeps_every_record_logged_before_it(tmp_path, monkeypatch):
    class Boom(Callback):
        def on_step_end(self, config, state, control, **kw):
            if state.global_step == 7:
                raise RuntimeError("boom")

    slow_writes(monkeypatch)
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        train(tmp_path / "out", recorder, Boom())
    assert [r["step"] for r in recorder.records] == [2, 4, 6]
    assert files(tmp_path / "out") == (recorder.records, recorder.records)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Both signalled runs, started together (each spends most of its time importing torch):
    {how: (output dir, exit code, stderr, the records it handed to the loggers)}."""
    procs = {}
    for how in ("sigterm", "sigkill"):
        out = tmp_path_factory.mktemp(how) / "out"
        procs[how] = (
            out,
            subprocess.Popen(
                [sys.executable, "-m", "tests.loggers.writer_worker", str(out), how],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": REPO},
            ),
        )
    results = {}
    for how, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        logged = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("LOG ")]
        results[how] = out, proc.returncode, stderr[-2000:], logged
    return results


def test_sigterm_flushes_the_queue_and_still_dies_of_sigterm(workers):
    out, code, stderr, logged = workers["sigterm"]
    assert code == -signal.SIGTERM, stderr
    assert [r["step"] for r in logged] == [2, 4, 6]
    assert files(out) == (logged, logged)


def test_kill_and_resume_gives_the_uninterrupted_files(tmp_path, monkeypatch, workers):
    killed_dir, code, stderr, logged = workers["sigkill"]
    assert code == -signal.SIGKILL and [r["step"] for r in logged] == [2, 4], stderr
    assert files(killed_dir) == (logged, logged)  # flushed before the checkpoint was written
    slow_writes(monkeypatch)
    train(killed_dir, resume=True)
    train(tmp_path / "full")
    killed, full = files(killed_dir), files(tmp_path / "full")
    assert [r["step"] for r in full[0]] == [2, 4, 6, 8, 10, 12, 12]
    assert without_timing(killed[0]) == without_timing(full[0]) and without_timing(killed[1]) == without_timing(full[1])
    with open(killed_dir / "runs" / "metrics.csv") as a, open(tmp_path / "full" / "runs" / "metrics.csv") as b:
        assert a.readline() == b.readline()  # the same header, in the same order


def test_a_failed_write_is_raised_on_the_training_thread():
    writer = writer_module.BackgroundWriter()
    done: list[int] = []

    def fail():
        raise OSError("disk full")

    writer.submit(fail)
    writer.submit(done.append, 1)  # later writes still run, in order
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    assert done == [1]
    writer.flush()  # reported once


def test_submit_does_not_wake_the_writer_and_flush_does():
    writer = writer_module.BackgroundWriter(wake_s=3600.0)
    ran = threading.Event()
    writer.submit(lambda: None)
    writer.flush()  # the thread is up and idle, waiting for its (hour-long) tick
    writer.submit(ran.set)
    assert not ran.wait(0.5), "submit woke the writer: it should only append to the queue"
    writer.flush(timeout=60)
    assert ran.is_set(), "flush did not wake the writer"


def test_the_writer_wakes_by_itself_without_a_flush():
    writer = writer_module.BackgroundWriter(wake_s=0.01)
    ran = threading.Event()
    writer.submit(ran.set)
    assert ran.wait(60)


def test_a_full_queue_wakes_the_writer_instead_of_waiting_for_its_tick():
    writer = writer_module.BackgroundWriter(maxsize=2, wake_s=3600.0)
    done: list[int] = []

    def produce():  # would wait an hour at the third submit if a full queue did not wake the writer
        for i in range(7):
            writer.submit(done.append, i)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(60)
    assert not producer.is_alive(), "submit on a full queue waited for the writer's tick"
    writer.flush(timeout=60)
    assert done == list(range(7))


class CountingLogger(Logger):
    """Records what it was handed, on which thread, and how often it was flushed."""

    name = "counting"

    def __init__(self, config, fail_at=None) -> None:
        super().__init__(config)
        self.points, self.flushes, self.fail_at = [], 0, fail_at

    def log_metrics(self, metrics, step):
        if step == self.fail_at:
            raise OSError(f"cannot write step {step}")
        self.points.append((step, metrics["loss"]))

    def flush(self):
        self.flushes += 1


def log(callback, steps):
    state, control = TrainerState(max_steps=100), TrainerControl()
    for step in steps:
        state.global_step = step
        callback.on_log(None, state, control, logs={"loss": step / 10})


def test_a_batch_of_records_is_one_write_task_and_one_flush_per_logger(tmp_path):
    cfg = make_config(tmp_path)
    loggers = [CountingLogger(cfg), CountingLogger(cfg)]
    callback = LoggerCallback(cfg, loggers)
    callback.writer = writer_module.BackgroundWriter(wake_s=3600.0)  # nothing runs before the flush
    log(callback, range(1, 11))
    assert len(callback.writer._tasks) == 1  # one task for the ten records
    callback.writer.flush(timeout=60)
    log(callback, [11])
    callback.writer.flush(timeout=60)
    for logger in loggers:
        assert logger.points == [(s, s / 10) for s in range(1, 12)] and logger.flushes == 2


def test_a_failing_record_loses_no_other_record_and_is_raised_on_the_training_thread(tmp_path):
    cfg = make_config(tmp_path)
    failing, healthy = CountingLogger(cfg, fail_at=3), CountingLogger(cfg)
    callback = LoggerCallback(cfg, [failing, healthy])
    callback.writer = writer_module.BackgroundWriter(wake_s=3600.0)
    log(callback, range(1, 6))
    with pytest.raises(OSError, match="cannot write step 3"):
        callback.writer.flush(timeout=60)
    assert failing.points == [(s, s / 10) for s in (1, 2, 4, 5)] and failing.flushes == 1
    assert healthy.points == [(s, s / 10) for s in range(1, 6)]
    log(callback, [6])  # the queue was emptied: the next record starts a new batch
    callback.writer.flush(timeout=60)
    assert healthy.points[-1] == (6, 0.6)


def test_records_do_not_pile_up_behind_a_slow_logger(tmp_path):
    cfg = make_config(tmp_path)
    logger = CountingLogger(cfg)
    callback = LoggerCallback(cfg, [logger])
    callback.writer = writer_module.BackgroundWriter(maxsize=4, wake_s=3600.0)
    log(callback, range(1, 10))  # the writer's tick is an hour away: only a full backlog makes it run
    assert len(callback._records) < 4 and len(logger.points) >= 4
    callback.writer.flush(timeout=60)
    assert logger.points == [(s, s / 10) for s in range(1, 10)]
