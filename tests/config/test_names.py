"""Validation knows the plug-in names from config's own floor (kiln.config.names), without importing the
floors that implement them, and still accepts a name registered at run time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.config import load_config
from kiln.config.names import PRECISION_GROUPS, STRATEGY_GROUPS, VOCABULARY, check_name
from kiln.registry import Registry, UnknownNameError, published_names
from kiln.utils.errors import ConfigError


def _registries() -> dict[str, Registry]:
    from kiln.loggers import LOGGERS
    from kiln.optim.optimizers import OPTIMIZERS
    from kiln.optim.schedulers import SCHEDULERS
    from kiln.precision import PRECISIONS
    from kiln.strategies import STRATEGIES

    return {r.config_key: r for r in (STRATEGIES, PRECISIONS, OPTIMIZERS, SCHEDULERS, LOGGERS)}


def _own_names(registry: Registry) -> list[str]:
    """The names kiln itself registers (plug-ins other tests register are left out)."""

    def module_of(name: str) -> str:
        return registry._lazy[name] if name in registry._lazy else registry.get(name).__module__

    return sorted(n for n in registry.names() if module_of(n).startswith("kiln."))


@pytest.mark.parametrize("key", sorted(VOCABULARY))
def test_the_vocabulary_names_exactly_the_registered_implementations(key: str) -> None:
    registry = _registries()[key]
    kind, builtin = VOCABULARY[key]
    assert sorted(builtin) == _own_names(registry)
    assert kind == registry.kind  # errors read the same whichever side raises them
    assert published_names(key) == registry.names()  # the floor published the registry validation reads


def test_each_alias_group_is_one_module() -> None:
    from kiln.precision import PRECISIONS
    from kiln.strategies import STRATEGIES

    for registry, groups in ((STRATEGIES, STRATEGY_GROUPS), (PRECISIONS, PRECISION_GROUPS)):
        modules = [{registry._lazy[name] for name in group} for group in groups]
        assert all(len(m) == 1 for m in modules)
        assert len({m.pop() for m in modules}) == len(groups)


def test_an_unknown_strategy_is_refused_with_the_valid_names(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"Unknown strategy 'dpp'.*Did you mean 'ddp'\?.*Valid names: auto, cpu"):
        load_config({"output_dir": str(tmp_path), "strategy": "dpp"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "optim",
            {"name": "adamw_torhc"},
            r"Unknown optimizer 'adamw_torhc' in `optim.name`\. Did you mean 'adamw_torch'\?",
        ),
        ("scheduler", {"name": "cosin"}, r"Unknown lr scheduler 'cosin' in `scheduler.name`\. Did you mean 'cosine'\?"),
        ("precision", {"name": "bf61"}, r"Unknown precision plugin 'bf61' in `precision.name`\."),
        (
            "log",
            {"report_to": ["tensorbord"]},
            r"Unknown logger 'tensorbord' in `log.report_to`\. Did you mean 'tensorboard'\?",
        ),
        ("log", {"history": ["jsonll"]}, r"Unknown logger 'jsonll' in `log.report_to`\. Did you mean 'jsonl'\?"),
    ],
)
def test_each_unknown_name_is_refused_with_the_closest_one(tmp_path, key, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"output_dir": str(tmp_path), key: value})


def test_loading_a_config_imports_no_floor_above_config(tmp_path) -> None:
    code = (
        "import sys\nfrom kiln.config import load_config\n"
        f"load_config({{'output_dir': {str(tmp_path)!r}, 'strategy': 'deepspeed_stage_3', 'optim': 'lomo', "
        "'precision': 'bf16', 'report_to': ['wandb']})\n"
        "print([m for m in sys.modules if m.startswith(('kiln.strategies', 'kiln.engine', 'kiln.optim', "
        "'kiln.loggers', 'kiln.precision'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_name_registered_at_run_time_is_accepted(monkeypatch) -> None:
    registries = _registries()
    for key in VOCABULARY:
        with pytest.raises(UnknownNameError):
            check_name(key, "my_plugin")
        monkeypatch.setitem(registries[key]._entries, "my_plugin", object)
        check_name(key, "my_plugin")
