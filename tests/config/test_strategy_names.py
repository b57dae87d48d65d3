"""Validation knows the strategy names from config's own floor (kiln.config.strategy_names), without
importing kiln.strategies, and still accepts a name registered at run time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.config import load_config
from kiln.config.strategy_names import STRATEGY_MODULES, check_strategy_name
from kiln.registry import UnknownNameError
from kiln.utils.errors import ConfigError


def test_the_table_names_exactly_the_registered_strategies() -> None:
    from kiln.strategies import STRATEGIES

    table = {name: module for names, module in STRATEGY_MODULES for name in names}
    def module_of(name: str) -> str:
        return STRATEGIES._lazy[name] if name in STRATEGIES._lazy else STRATEGIES.get(name).__module__

    own = sorted(n for n in STRATEGIES.names() if module_of(n).startswith("kiln."))
    assert sorted(table) == own  # plug-ins other tests register (not kiln's) are left out
    assert all(STRATEGIES._lazy.get(name, module) == module for name, module in table.items())


def test_an_unknown_strategy_is_refused_with_the_valid_names(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"Unknown strategy 'dpp'.*Did you mean 'ddp'\?.*Valid names: auto, cpu"):
        load_config({"output_dir": str(tmp_path), "strategy": "dpp"})


def test_loading_a_config_does_not_import_the_strategies(tmp_path) -> None:
    code = ("import sys\nfrom kiln.config import load_config\n"
            f"load_config({{'output_dir': {str(tmp_path)!r}, 'strategy': 'deepspeed_stage_3'}})\n"
            "print([m for m in sys.modules if m == 'kiln.engine' or m.startswith(('kiln.strategies', 'kiln.engine.'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_strategy_registered_at_run_time_is_accepted(monkeypatch) -> None:
    from kiln.strategies import STRATEGIES

    with pytest.raises(UnknownNameError):
        check_strategy_name("my_strategy")
    monkeypatch.setitem(STRATEGIES._entries, "my_strategy", object)
    check_strategy_name("my_strategy")
