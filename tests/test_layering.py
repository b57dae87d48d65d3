"""Imports only go down the floors (DESIGN.md): the lower layers never import the engine, and config,
the lowest floor above utils, imports neither the strategies nor the engine. Every import counts: at
module level, inside functions and under `if TYPE_CHECKING:` (a type is a dependency too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kiln"
LOWER = ("config", "loggers", "precision", "accelerators", "strategies", "launch", "utils", "optim")


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from kiln import engine`
    return names


def offenders(folders: tuple[str, ...], forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for name in sorted(imported_modules(path, root)):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(root.parent)} imports {name}")
    return found


@pytest.mark.parametrize("folder", LOWER)
def test_lower_floors_never_import_the_engine(folder: str) -> None:
    assert offenders((folder,), ("kiln.engine",)) == []


def test_config_imports_neither_strategies_nor_engine() -> None:
    assert offenders(("config",), ("kiln.strategies", "kiln.engine")) == []


def test_the_check_sees_function_local_relative_and_type_only_imports(tmp_path: Path) -> None:
    """The guard itself: imports hidden in a function, relative ones and TYPE_CHECKING ones are found."""
    package = tmp_path / "kiln" / "config"
    package.mkdir(parents=True)
    (package / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kiln.engine.trainer import Trainer\n"
        "def f():\n    from ..strategies import STRATEGIES\n    import kiln.engine.loop\n"
        "def g():\n    from .. import engine\n")
    (package / "good.py").write_text("from kiln.registry import Registry\nfrom . import bad\n")
    found = offenders(("config",), ("kiln.strategies", "kiln.engine"), root=tmp_path / "kiln")
    assert all(line.startswith("kiln/config/bad.py imports ") for line in found)
    assert {"kiln.engine", "kiln.engine.loop", "kiln.engine.trainer", "kiln.strategies"} <= {
        line.split(" imports ")[1] for line in found}
