"""The config is kiln's settings as loaded, read-only (OmegaConf's flag): code reads it and never writes
into it (a value a strategy derives is its own attribute; a changed config is a new load). A strategy named to the Trainer is a config value, so the
saved config names the strategy that ran."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import TinyRegressor, base_config, regression_data

ROOT = Path(__file__).resolve().parents[2] / "kiln"
BELOW_THE_ENGINE = ("strategies", "precision", "loggers", "optim", "accelerators", "launch", "utils")
#: file -> why it still writes (the write moves when its caller passes the result on)
KNOWN: dict[str, str] = {}
_WRITERS = ("open_dict", "read_write", "update", "set_readonly", "set_struct", "merge_with")


def _config_root(node: ast.AST) -> bool:
    """`config`, `cfg.x[...]`, `self.config.x`: a config or a node inside one."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "config"
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in ("config", "cfg")


def config_writes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        found += [
            f"{path.name}:{node.lineno} assigns {ast.unparse(t)}"
            for t in targets
            if isinstance(t, (ast.Attribute, ast.Subscript)) and _config_root(t.value)
        ]
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _WRITERS and node.args and _config_root(node.args[0]):
                found.append(f"{path.name}:{node.lineno} calls {name}({ast.unparse(node.args[0])})")
    return found


@pytest.mark.parametrize("floor", BELOW_THE_ENGINE)
def test_no_code_below_the_engine_writes_into_the_config(floor: str) -> None:
    writes = {str(p.relative_to(ROOT.parent)): config_writes(p) for p in sorted((ROOT / floor).rglob("*.py"))}
    assert {path: found for path, found in writes.items() if found and path not in KNOWN} == {}


def test_the_guard_sees_each_kind_of_write(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from omegaconf import OmegaConf, open_dict\n"
        "def f(config, cfg, other):\n"
        "    with open_dict(config):\n        config.strategy.name = 'x'\n"
        "    cfg.train['max_steps'] += 1\n"
        "    OmegaConf.update(cfg, 'seed', 1)\n"
        "    other.name = 'fine'\n"
        "class S:\n    def g(self):\n        self.config.seed = 2\n        self.settings = 3\n"
    )
    found = config_writes(bad)
    assert [line.split(" ", 1)[1] for line in found] == sorted(
        [
            "calls open_dict(config)",
            "assigns config.strategy.name",
            "assigns cfg.train['max_steps']",
            "calls update(cfg)",
            "assigns self.config.seed",
        ],
        key=[line.split(" ", 1)[1] for line in found].index,
    )
    assert len(found) == 5


def test_a_strategy_named_to_the_trainer_is_the_configs(tmp_path: Path) -> None:
    from kiln import Trainer

    cfg = base_config(tmp_path, max_steps=1)
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(8), strategy="cpu")
    assert trainer.config.strategy.name == "cpu" and trainer.strategy.name in ("single", "cpu")
    assert trainer.checkpoints.saved_tree()["strategy"]["name"] == "cpu"  # config.yaml names what ran
    read_only = OmegaConf.create(OmegaConf.to_container(trainer.config))
    OmegaConf.set_readonly(read_only, True)
    from kiln.strategies import build_strategy

    assert type(build_strategy(read_only, trainer.precision)) is type(trainer.strategy)  # reads only


def test_the_loaded_config_is_read_only(tmp_path: Path) -> None:
    """A write into the Trainer's config (or any loaded one) fails at the write; a changed config is a new load,
    which leaves the old one as it was."""
    from omegaconf.errors import ReadonlyConfigError

    from kiln import Trainer
    from kiln.config.load import load_config

    trainer = Trainer(TinyRegressor(), base_config(tmp_path, max_steps=1), train_dataset=regression_data(8))
    for write in (
        lambda: setattr(trainer.config, "seed", 7),
        lambda: setattr(trainer.args.train, "max_steps", 7),
        lambda: trainer.config.strategy.options.__setitem__("mesh", {"tp": 2}),
    ):
        with pytest.raises(ReadonlyConfigError):
            write()
    changed = load_config(trainer.config, {"seed": 7})
    assert changed.seed == 7 and trainer.config.seed != 7 and OmegaConf.is_readonly(changed)
