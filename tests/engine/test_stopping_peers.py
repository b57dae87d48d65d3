"""`stopping_peers` (kiln/engine/loop/fit_errors.py) around fit(): an Exception aborts the strategy's process
group, a KeyboardInterrupt does not, a rank whose collective broke on a peer's abort names that peer
(RankFailed), the failing rank's own exception leaves unchanged, and a later fit() in the aborted process
says why it cannot run. And `record_failure` (kiln/strategies/abort.py): the first rank's record wins.
The 2-process worlds are tests/distributed/test_failed_fit_stops_peers.py."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kiln.engine.checkpoint.in_use import OutputDirInUse
from kiln.engine.checkpoint.lease import LeaseLost
from kiln.engine.loop.fit_errors import stopping_peers
from kiln.strategies import abort, process_group
from kiln.utils.errors import (
    CapabilityError,
    CheckpointError,
    ConfigError,
    KilnError,
    PrecisionError,
    RankFailed,
    TrainingInterrupted,
)


class Strategy:
    """What `stopping_peers` asks of a strategy: `abort` (returning an earlier rank's record) and `aborted`."""

    def __init__(self, first: dict | None = None) -> None:
        self.first, self.aborted, self.errors = first, False, []

    def abort(self, error: BaseException) -> dict | None:
        self.errors.append(error)
        self.aborted = True
        return self.first


def test_the_failing_rank_aborts_and_raises_its_own_exception_unchanged():
    strategy, error = Strategy(), ValueError("boom")
    with pytest.raises(ValueError) as raised, stopping_peers(strategy):  # type: ignore[arg-type]
        raise error
    assert raised.value is error and strategy.errors == [error]


def test_a_rank_whose_collective_broke_on_a_peers_abort_names_that_peer():
    strategy = Strategy({"rank": 3, "error": "ValueError: boom"})
    broken = RuntimeError("Connection closed by peer [127.0.0.1]:4992")
    with pytest.raises(RankFailed) as raised, stopping_peers(strategy):  # type: ignore[arg-type]
        raise broken
    assert str(raised.value) == (
        "rank 3 failed with ValueError: boom; this rank's collective broke when that rank aborted the process "
        "group to stop the job. Look at that rank's output for the cause."
    )
    assert raised.value.__cause__ is broken


@pytest.mark.parametrize("error", [ValueError("its own"), KilnError("its own sentence")])
def test_a_rank_with_an_error_of_its_own_keeps_it_even_after_a_peer_failed(error):
    strategy = Strategy({"rank": 0, "error": "ValueError: boom"})
    with pytest.raises(type(error)) as raised, stopping_peers(strategy):  # type: ignore[arg-type]
        raise error
    assert raised.value is error and strategy.aborted


@pytest.mark.parametrize(
    "refusal",
    [
        ConfigError("a config refused"),
        PrecisionError("a precision refused"),
        CapabilityError("a combination refused"),
        CheckpointError("a checkpoint refused"),
        LeaseLost("the lock was taken over"),
        OutputDirInUse("the output_dir is in use"),
    ],
)
def test_kilns_refusals_which_every_rank_raises_alike_abort_nothing_and_a_later_fit_runs(refusal):
    """A script may catch a refusal (a bad path to resume from), fix it and fit again in the same processes:
    the group is kept."""
    strategy = Strategy()
    with pytest.raises(type(refusal)) as raised, stopping_peers(strategy):  # type: ignore[arg-type]
        raise refusal
    assert raised.value is refusal and not strategy.aborted and strategy.errors == []
    with stopping_peers(strategy):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), TrainingInterrupted("interrupted at step 3")])
def test_a_ctrl_c_aborts_nothing(interrupt):
    strategy = Strategy()
    with pytest.raises(KeyboardInterrupt), stopping_peers(strategy):  # type: ignore[arg-type]
        raise interrupt
    assert strategy.errors == [] and not strategy.aborted


def test_a_fit_that_ends_normally_aborts_nothing():
    strategy = Strategy()
    with stopping_peers(strategy):  # type: ignore[arg-type]
        pass
    assert strategy.errors == []


def test_a_later_fit_in_an_aborted_process_says_why_it_cannot_run():
    strategy = Strategy()
    strategy.aborted = True
    with pytest.raises(
        KilnError, match=r"^fit\(\) cannot run again in this process: an earlier fit\(\) failed and aborted"
    ):
        with stopping_peers(strategy):  # type: ignore[arg-type]
            raise AssertionError("the body must not run")


def _no_group() -> None:
    raise ValueError("Default process group has not been initialized")


def test_the_first_ranks_record_wins_and_each_rank_learns_whether_it_was_first(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(process_group, "_KEPT_STORE", [])
    assert abort.record_failure(1, ValueError("first")) is None  # rank 1 failed first
    assert abort.record_failure(0, RuntimeError("Connection closed by peer")) == {
        "rank": 1,
        "error": "ValueError: first",
    }
    assert abort.record_failure(1, ValueError("again")) is None  # its own record: still the first
    assert abort.record_failure(2, ValueError("first")) is None  # the same error: raised alike, not stopped by rank 1
    assert json.loads(store.get(abort.FAILED_FIT)) == {"rank": 1, "error": "ValueError: first"}
    assert process_group._KEPT_STORE == [store]  # kept beyond the group: a store rank 0 hosts answers the peers
    monkeypatch.setattr(c10d, "_get_default_store", _no_group)  # the group is gone
    assert process_group.default_store() is store  # lost_peer_note can still read the ranks' identities


def test_without_a_store_nothing_is_recorded(monkeypatch):
    monkeypatch.setattr(abort, "keep_default_store", lambda: None)
    assert abort.record_failure(0, ValueError("boom")) is None


def test_the_abort_releases_the_strategys_holds_then_frees_every_group(caplog):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    calls: list[bool] = []
    try:
        assert abort.abort_default_group("gloo", lambda: calls.append(dist.is_initialized()), first=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert calls == [True] and not dist.is_initialized()  # released before the groups were destroyed
    assert "still holds it" not in caplog.text


@pytest.mark.parametrize("first", [True, False])
def test_a_group_held_elsewhere_is_reported_by_the_rank_that_failed_first(caplog, first):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    held = dist.group.WORLD  # as something outside kiln would
    with caplog.at_level("WARNING", logger="kiln.strategies.abort"):
        assert not abort.abort_default_group("gloo", lambda: None, first=first)
    del held
    assert ("the other ranks may wait until the collective timeout" in caplog.text) is first
