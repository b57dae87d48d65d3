"""The estimate's split trace runs DTensor's sharding propagation outside its own fake mode
(kiln/estimate/trace.py `_untracked_propagation`) through a private torch method: put back after the
trace, and skipped (the trace still runs) on a torch that no longer has it."""

from __future__ import annotations

import pytest
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from kiln.estimate.trace import _untracked_propagation

NAME = "_propagate_tensor_meta_non_cached"


def test_the_propagation_is_wrapped_during_the_trace_and_put_back_after():
    original = getattr(ShardingPropagator, NAME)
    with _untracked_propagation():
        assert getattr(ShardingPropagator, NAME) is not original
    assert getattr(ShardingPropagator, NAME) is original


def test_a_torch_without_the_method_traces_without_the_wrap(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delattr(ShardingPropagator, NAME)
    with _untracked_propagation():
        assert not hasattr(ShardingPropagator, NAME)
    assert not hasattr(ShardingPropagator, NAME)
