"""kiln.engine.checkpoint.background: one save in flight, its failure kept for the training thread."""

from __future__ import annotations

import threading

import pytest

from kiln.engine.checkpoint.background import BackgroundSave


def test_the_job_runs_on_a_named_thread_and_join_waits_for_it():
    save, release, ran = BackgroundSave(), threading.Event(), []

    def job() -> None:
        assert release.wait(10)
        ran.append(threading.current_thread().name)

    save.start(8, job)
    assert save.in_flight and save.step == 8 and ran == []
    release.set()
    assert save.join() is None
    assert ran == ["kiln-checkpoint-8"] and not save.in_flight


def test_a_failure_is_kept_for_join_and_returned_once():
    save, err = BackgroundSave(), OSError("disk full")

    def job() -> None:
        raise err

    save.start(4, job)
    save.finish()  # waits, keeps the failure
    assert not save.in_flight
    assert save.join() is err
    assert save.join() is None


def test_a_second_save_while_one_is_in_flight_is_a_bug():
    save, release = BackgroundSave(), threading.Event()
    save.start(4, lambda: release.wait(10))
    with pytest.raises(AssertionError, match="already in flight"):
        save.start(8, lambda: None)
    release.set()
    assert save.join() is None
    save.start(8, lambda: None)  # after join, the next one may start
    assert save.join() is None


def test_join_without_a_save_returns_at_once():
    assert BackgroundSave().join() is None and not BackgroundSave().in_flight


def test_the_writer_thread_is_not_a_daemon():
    """A process that ends while a save is in flight finishes writing it first."""
    save, seen = BackgroundSave(), []
    save.start(1, lambda: seen.append(threading.current_thread().daemon))
    save.join()
    assert seen == [False]
