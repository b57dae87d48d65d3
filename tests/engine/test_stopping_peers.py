"""`stopping_peers` (kiln/engine/loop/fit_errors.py) around fit(): an Exception goes to the strategy's
`fit_failed` with this process's count of fit() calls, a KeyboardInterrupt does not, a rank whose collective
broke on a peer's abort names that peer (RankFailed), the failing rank's own exception leaves unchanged,
and a later fit() in an aborted process says why it cannot run. And the agreement (kiln/strategies/abort.py)
in an in-process store with a world of threads: every rank failed -> nothing aborted; the grace expired ->
one rank's record, and the abort; one verdict per fit() call. The 2-process worlds are
tests/distributed/test_failed_fit_stops_peers.py."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kiln.engine.loop import fit_errors
from kiln.engine.loop.fit_errors import stopping_peers
from kiln.strategies import abort, process_group
from kiln.strategies.abort import FitKeys
from kiln.strategies.collectives import ProcessGroupCollectives
from kiln.utils.errors import CheckpointError, ConfigError, KilnError, RankFailed, TrainingInterrupted


class Strategy:
    """What `stopping_peers` asks of a strategy: `fit_failed` (returning the record of a rank that aborted
    before this one failed) and `aborted`."""

    def __init__(self, first: dict | None = None) -> None:
        self.first, self.aborted, self.calls = first, False, []

    def fit_failed(self, error: BaseException, fit_call: int) -> dict | None:
        self.calls.append((error, fit_call))
        return self.first


def test_the_failing_rank_agrees_and_raises_its_own_exception_unchanged():
    strategy, error = Strategy(), ValueError("boom")
    with pytest.raises(ValueError) as raised, stopping_peers(strategy):  # type: ignore[arg-type]
        raise error
    assert raised.value is error and [e for e, _ in strategy.calls] == [error]


@pytest.mark.parametrize("refusal", [ConfigError("a config refused"), CheckpointError("a checkpoint refused")])
def test_kilns_refusals_go_to_the_agreement_too(refusal):
    """No exemption: a refusal raised on every rank is kept by the agreement, one raised on rank 0 alone must
    stop the peers."""
    strategy = Strategy()
    with pytest.raises(type(refusal)), stopping_peers(strategy):  # type: ignore[arg-type]
        raise refusal
    assert [e for e, _ in strategy.calls] == [refusal]


def test_each_fit_call_has_its_own_number(monkeypatch):
    monkeypatch.setattr(fit_errors, "_FIT_CALLS", [7])
    strategy = Strategy()
    for _ in range(2):
        with pytest.raises(ValueError), stopping_peers(strategy):  # type: ignore[arg-type]
            raise ValueError("boom")
    with stopping_peers(strategy):  # type: ignore[arg-type]  # a fit that ends normally counts too
        pass
    with pytest.raises(ValueError), stopping_peers(strategy):  # type: ignore[arg-type]
        raise ValueError("boom")
    assert [n for _, n in strategy.calls] == [7, 8, 10]


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
def test_a_rank_with_an_error_of_its_own_keeps_it_even_after_a_peer_aborted(error):
    strategy = Strategy({"rank": 0, "error": "ValueError: boom"})
    with pytest.raises(type(error)) as raised, stopping_peers(strategy):  # type: ignore[arg-type]
        raise error
    assert raised.value is error


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), TrainingInterrupted("interrupted at step 3")])
def test_a_ctrl_c_aborts_nothing(interrupt):
    strategy = Strategy()
    with pytest.raises(KeyboardInterrupt), stopping_peers(strategy):  # type: ignore[arg-type]
        raise interrupt
    assert strategy.calls == []


def test_a_fit_that_ends_normally_aborts_nothing():
    strategy = Strategy()
    with stopping_peers(strategy):  # type: ignore[arg-type]
        pass
    assert strategy.calls == []


def test_a_later_fit_in_an_aborted_process_says_why_it_cannot_run():
    strategy = Strategy()
    strategy.aborted = True
    with pytest.raises(
        KilnError, match=r"^fit\(\) cannot run again in this process: an earlier fit\(\) failed and aborted"
    ):
        with stopping_peers(strategy):  # type: ignore[arg-type]
            raise AssertionError("the body must not run")


# -- the agreement, in one store, ranks as threads ---------------------------------------------------------


def _world(store, keys, errors: dict[int, BaseException | None], grace_s: float, world_size: int = 2) -> dict:
    """Each rank whose error is not None calls `agree` at once, in a thread of its own; {rank: (decision,
    record, seconds it took)}."""
    out: dict = {}

    def rank(r: int, error: BaseException) -> None:
        start = time.monotonic()
        decision, first = abort.agree(store, keys, r, world_size, error, grace_s)
        out[r] = (decision, first, time.monotonic() - start)

    threads = [threading.Thread(target=rank, args=(r, e)) for r, e in errors.items() if e is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("messages", [("same", "same"), ("one", "another")])
def test_every_rank_failed_so_nothing_is_aborted(messages):
    store, keys = dist.HashStore(), FitKeys.of(0, 0)
    out = _world(store, keys, {0: ValueError(messages[0]), 1: TypeError(messages[1])}, grace_s=10)
    assert {r: out[r][:2] for r in out} == {0: ("kept", None), 1: ("kept", None)}
    assert max(t for _, _, t in out.values()) < 5  # no rank waited out the grace
    assert store.get(keys.verdict) == b"kept" and not store.check([keys.aborted])


def test_a_rank_failing_alone_aborts_after_the_grace_and_its_peer_is_stopped_by_its_record():
    store, keys = dist.HashStore(), FitKeys.of(0, 0)
    out = _world(store, keys, {0: ValueError("boom"), 1: None}, grace_s=0.3)
    decision, first, took = out[0]
    assert (decision, first) == ("abort", None) and 0.3 <= took < 5
    want = {"rank": 0, "error": "ValueError: boom"}
    assert json.loads(store.get(keys.verdict)) == want and json.loads(store.get(keys.aborted)) == want
    # rank 1's collective broke on the abort: it finds the record and stops at once, counting nothing
    start = time.monotonic()
    assert abort.agree(store, keys, 1, 2, RuntimeError("Connection closed by peer"), 10) == ("stopped", want)
    assert time.monotonic() - start < 1 and store.add(keys.failed, 0) == 1
    # so does a rank stopped in a later fit() call (it had finished this one): the record is the group's
    assert abort.agree(store, FitKeys.of(1, 0), 1, 2, RuntimeError("closed"), 10) == ("stopped", want)


def test_a_rank_counting_after_the_grace_expired_follows_the_abort():
    store, keys = dist.HashStore(), FitKeys.of(0, 0)
    assert abort.agree(store, keys, 0, 3, ValueError("first"), 0.05) == ("abort", None)
    store.delete_key(keys.aborted)  # only the verdict of this fit() call tells rank 2 what was decided
    first = {"rank": 0, "error": "ValueError: first"}
    assert abort.agree(store, keys, 2, 3, ValueError("late"), 0.05) == ("abort", first)
    # the last rank counts the world full, but the verdict was written: it aborts too, keeping no dead group
    store.delete_key(keys.aborted)
    assert abort.agree(store, keys, 1, 3, ValueError("last"), 10)[0] == "abort"
    assert store.add(keys.failed, 0) == 3


def test_two_ranks_whose_grace_expires_agree_on_one_record():
    store, keys = dist.HashStore(), FitKeys.of(0, 0)
    out = _world(store, keys, {0: ValueError("a"), 1: ValueError("b"), 2: None}, grace_s=0.3, world_size=3)
    winner = json.loads(store.get(keys.verdict))
    assert json.loads(store.get(keys.aborted)) == winner
    loser = 1 - winner["rank"]
    assert out[winner["rank"]][:2] == ("abort", None) and out[loser][:2] == ("abort", winner)


def test_each_fit_call_and_group_has_keys_of_its_own():
    store = dist.HashStore()
    first, second = FitKeys.of(0, 0), FitKeys.of(1, 0)
    assert _world(store, first, {0: ValueError("x"), 1: ValueError("x")}, grace_s=10)[0][:2] == ("kept", None)
    # call 0's count is not call 1's
    assert abort.agree(store, second, 0, 2, ValueError("alone"), 0.05) == ("abort", None)
    assert FitKeys.of(0, 1).aborted != first.aborted  # a group made again is not stopped by the last one's abort
    assert len({*first.__dict__.values(), *second.__dict__.values()}) == 5  # `aborted` is shared within a group


# -- the strategy's side: agree, then abort (or not) ---------------------------------------------------------


@pytest.fixture
def store(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(process_group, "_KEPT_STORE", [])
    return store


def _strategy(rank: int, monkeypatch, world_size: int = 2) -> tuple[SimpleNamespace, list]:
    """A process-group strategy of a fake world: its `fit_failed` with `abort_default_group` recorded."""
    aborts: list = []

    def abort_default_group(backend, release, first):  # type: ignore[no-untyped-def]
        release()
        aborts.append((backend, first))
        return True

    monkeypatch.setattr(abort, "abort_default_group", abort_default_group)
    strategy = SimpleNamespace(world_size=world_size, global_rank=rank, backend="gloo", aborted=False, torn=0)
    strategy.teardown = lambda: setattr(strategy, "torn", strategy.torn + 1)
    strategy._wrapped = strategy._source = object()
    return strategy, aborts


def test_the_strategy_keeps_the_group_when_every_rank_failed(store, monkeypatch):
    strategy, aborts = _strategy(0, monkeypatch)
    store.add(FitKeys.of(4, 0).failed, 1)  # rank 1's fit #4 failed too
    assert ProcessGroupCollectives.fit_failed(strategy, ValueError("x"), 4) is None  # type: ignore[arg-type]
    assert aborts == [] and not strategy.aborted and strategy.torn == 0
    assert process_group._KEPT_STORE == []


def test_the_strategy_aborts_when_the_grace_expires(store, monkeypatch):
    monkeypatch.setattr(abort, "GRACE_S", 0.05)
    strategy, aborts = _strategy(1, monkeypatch)
    assert ProcessGroupCollectives.fit_failed(strategy, ValueError("boom"), 4) is None  # type: ignore[arg-type]
    assert aborts == [("gloo", True)] and strategy.aborted and strategy.torn == 1
    assert strategy._wrapped is None and strategy._source is None  # its holds on the group dropped
    assert json.loads(store.get(FitKeys.of(4, 0).aborted)) == {"rank": 1, "error": "ValueError: boom"}
    assert process_group._KEPT_STORE == [store]  # kept beyond the group: a store rank 0 hosts answers the peers
    monkeypatch.setattr(c10d, "_get_default_store", _no_group)  # the group is gone
    assert process_group.default_store() is store  # lost_peer_note can still read the ranks' identities
    peer, peer_aborts = _strategy(0, monkeypatch)
    broken = RuntimeError("Connection closed by peer")
    assert ProcessGroupCollectives.fit_failed(peer, broken, 4) == {"rank": 1, "error": "ValueError: boom"}  # type: ignore[arg-type]
    assert peer_aborts == [("gloo", False)] and peer.aborted  # the peer frees its broken group, warning of nothing


def test_a_broken_collective_of_its_own_is_not_warned_about(store, monkeypatch):
    """A survivor of a rank that died: its error's traceback may hold the group; its own error names the cause."""
    monkeypatch.setattr(abort, "GRACE_S", 0.05)
    strategy, aborts = _strategy(0, monkeypatch)
    assert ProcessGroupCollectives.fit_failed(strategy, RuntimeError("Connection reset"), 0) is None  # type: ignore[arg-type]
    assert aborts == [("gloo", False)]


def test_one_process_agrees_with_nobody(store, monkeypatch):
    strategy, aborts = _strategy(0, monkeypatch, world_size=1)
    assert ProcessGroupCollectives.fit_failed(strategy, ValueError("x"), 0) is None  # type: ignore[arg-type]
    assert aborts == [] and not store.check([FitKeys.of(0, 0).failed])


def _no_group() -> None:
    raise ValueError("Default process group has not been initialized")


def test_without_a_store_that_answers_the_rank_aborts_at_once(monkeypatch):
    monkeypatch.setattr(process_group, "_KEPT_STORE", [])
    monkeypatch.setattr(c10d, "_get_default_store", _no_group)
    assert abort.fit_failed(0, 2, 0, ValueError("x")) == ("abort", None)

    class Gone:
        def check(self, keys):  # type: ignore[no-untyped-def]
            raise RuntimeError("Connection refused")

    monkeypatch.setattr(c10d, "_get_default_store", Gone)
    start = time.monotonic()
    assert abort.fit_failed(0, 2, 0, ValueError("x")) == ("abort", None)
    assert time.monotonic() - start < 1


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


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_communicators_are_aborted_before_anything_is_released(monkeypatch, backend):
    """ncclCommAbort first (a kernel in flight is cancelled rather than waited for); gloo has no working abort."""
    calls: list[str] = []
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a, **k: calls.append("abort"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        abort.abort_default_group(backend, lambda: calls.append("release"), first=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert calls == (["abort", "release"] if backend == "nccl" else ["release"])
