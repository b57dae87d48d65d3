"""`xla` joins the strategy contract suite (tests/strategies/contract) with one process, in the XLA
environment: every scenario gives `single`'s numbers or is refused up front by its capabilities.
(`xla_fsdp`'s SPMD mode switches the whole process over, so it is checked in test_xla_spmd.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")

from tests.strategies.contract import scenarios  # noqa: E402
from tests.strategies.contract import test_contract as contract  # noqa: E402
from tests.strategies.contract.scenarios import run_all  # noqa: E402


def test_xla_matches_single_or_refuses_up_front(tmp_path, monkeypatch):
    monkeypatch.setitem(contract.STRATEGIES, "xla", ("xla", 1, 1e-5))
    pinned = scenarios.config

    def unpinned(*args, **kwargs):  # the suite pins strategy.device to the CPU; `xla` picks its device
        cfg = pinned(*args, **kwargs)
        cfg["strategy"] = {}
        return cfg

    monkeypatch.setattr(scenarios, "config", unpinned)
    reference = run_all("single", str(tmp_path / "single"), 1)
    (tmp_path / "xla").mkdir()
    contract.test_strategy_matches_single_or_refuses_up_front(
        "xla", reference, None, tmp_path / "xla"
    )  # one process: no world
