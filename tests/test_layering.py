"""Imports only go down the floors (DESIGN.md): the lower layers never import the engine, and config,
the lowest floor above utils, imports none of the floors above it. Every import counts: at module level,
inside functions and under `if TYPE_CHECKING:` (a type is a dependency too), and so does a module named
by a string, which is imported later all the same: `importlib.import_module("kiln.x")`, `__import__`, a
registry's lazy entry, `sys.modules.get("kiln.x")`, `python -m kiln.x` or `-c "import kiln.x"` in a
command line.

Settings travel in the config, so only launch code touches the environment (kiln/launch/: the launchers,
the cluster kinds and environment/variables.py); every other read or write is an exception listed in
`ENV_READS` with its reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kiln"
LOWER = ("config", "loggers", "precision", "accelerators", "strategies", "launch", "utils", "optim")
#: the floors above config (all but utils, which config may import)
ABOVE_CONFIG = (
    "kiln.engine",
    "kiln.strategies",
    "kiln.optim",
    "kiln.loggers",
    "kiln.precision",
    "kiln.accelerators",
    "kiln.launch",
    "kiln.cli",
    "kiln.docgen",
)

_DOTTED = re.compile(r"kiln(?:\.\w+)+")
#: a module named in code or a command line held in a string: `from kiln.x import`, `-m kiln.x`, `import a, kiln.x`
_IN_CODE = re.compile(r"(?:\bfrom|-m)\s+(kiln(?:\.\w+)+)")
_IMPORT_LIST = re.compile(r"\bimport\s+([\w.]+(?:\s*,\s*[\w.]+)*)")


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def named_modules(tree: ast.AST) -> set[str]:
    """Modules a file names by string outside its docstrings: a string that is a dotted kiln name (a
    registry entry, an `import_module` or `sys.modules` key, a `-m` argument), the kiln modules a string of
    code or a command line imports, and the fixed head of an f-string (`f"kiln.loggers.{name}"`)."""
    names: set[str] = set()
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith("kiln."):
                if match := _DOTTED.match(head.value.rstrip(".")):
                    names.add(match.group(0))
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        if _DOTTED.fullmatch(node.value):
            names.add(node.value)
        names.update(_IN_CODE.findall(node.value))
        for listed in _IMPORT_LIST.findall(node.value):
            names.update(n for n in re.split(r"\s*,\s*", listed) if _DOTTED.fullmatch(n))
    return names


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved) or names by string."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names = named_modules(tree)
    for node in ast.walk(tree):
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


def test_config_imports_no_floor_above_it() -> None:
    assert offenders(("config",), ABOVE_CONFIG) == []


def test_no_floor_below_the_cli_names_the_cli() -> None:
    """The CLI runs the engine; a lower floor that needs it (Ray's workers) is handed a function instead."""
    assert offenders(LOWER, ("kiln.cli",)) == []


def test_the_check_sees_function_local_relative_and_type_only_imports(tmp_path: Path) -> None:
    """The guard itself: imports hidden in a function, relative ones and TYPE_CHECKING ones are found."""
    package = tmp_path / "kiln" / "config"
    package.mkdir(parents=True)
    (package / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kiln.engine.trainer import Trainer\n"
        "def f():\n    from ..strategies import STRATEGIES\n    import kiln.engine.loop\n"
        "def g():\n    from .. import engine\n"
    )
    (package / "good.py").write_text("from kiln.registry import Registry\nfrom . import bad\n")
    found = offenders(("config",), ("kiln.strategies", "kiln.engine"), root=tmp_path / "kiln")
    assert all(line.startswith("kiln/config/bad.py imports ") for line in found)
    assert {"kiln.engine", "kiln.engine.loop", "kiln.engine.trainer", "kiln.strategies"} <= {
        line.split(" imports ")[1] for line in found
    }


def test_the_check_sees_modules_named_by_string(tmp_path: Path) -> None:
    """The guard itself: every way kiln names a module in a string is an import; docstrings are not."""
    package = tmp_path / "kiln" / "launch"
    package.mkdir(parents=True)
    (package / "bad.py").write_text(
        '"""Runs `python -m kiln.cli.docstring`, which is prose."""\n'
        "import importlib, subprocess, sys\n"
        "def f(name):\n"
        "    importlib.import_module('kiln.cli')\n"
        "    __import__('kiln.engine.trainer', fromlist=['Trainer'])\n"
        "    sys.modules.get('kiln.engine.loop')\n"
        "    subprocess.run([sys.executable, '-m', 'kiln.engine.cli_m'])\n"
        "    subprocess.run([sys.executable, '-c', 'import sys, kiln.engine.code_c'])\n"
        "    subprocess.run('python -m kiln.engine.shell_m fit', shell=True)\n"
        "    importlib.import_module(f'kiln.engine.plugins.{name}')\n"
        "TABLE = ((('x',), 'kiln.engine.lazy'),)\n"
        "MESSAGE = 'see kiln.engine.prose for why'\n"
    )
    found = {
        line.split(" imports ")[1]
        for line in offenders(("launch",), ("kiln.engine", "kiln.cli"), root=tmp_path / "kiln")
    }
    assert found == {
        "kiln.cli",
        "kiln.engine.trainer",
        "kiln.engine.loop",
        "kiln.engine.cli_m",
        "kiln.engine.code_c",
        "kiln.engine.shell_m",
        "kiln.engine.plugins",
        "kiln.engine.lazy",
    }


#: the environment outside kiln/launch/: file -> (how many reads or writes, why it is not launch code's)
ENV_READS: dict[str, tuple[int, str]] = {
    "kiln/config/redact.py": (1, "the value a `${oc.env:VAR}` the user wrote in the config resolves to, to mask it"),
    "kiln/engine/checkpoint/signing.py": (
        1,
        "the signing key, from the variable the user names in save.signing_key_env",
    ),
    "kiln/loggers/base.py": (1, "a tracker's setting from its own variable when the config leaves it unset (HF's)"),
    "kiln/loggers/mlflow.py": (3, "MLflow's own variables (tags, run to continue, tracking URI), as HF's callback"),
    "kiln/loggers/wandb.py": (5, "W&B's credentials and mode, which never go into a saved config"),
    "kiln/loggers/comet.py": (1, "Comet's import-time settings, which comet_ml reads only from the environment"),
}
_ENV_NAMES = {"environ", "getenv", "putenv", "unsetenv", "environb"}


def env_reads(path: Path) -> list[int]:
    """Lines where `path` reads or writes the environment: `os.environ` (any use), `os.getenv`/`putenv`/`unsetenv`,
    or those names imported from os."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in _ENV_NAMES]
    lines += [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "os" and any(a.name in _ENV_NAMES for a in n.names)
    ]
    return sorted(lines)


def env_offenders(root: Path = ROOT, allowed: dict[str, tuple[int, str]] = ENV_READS) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        name = str(path.relative_to(root.parent))
        if name.startswith("kiln/launch/"):
            continue
        lines = env_reads(path)
        if lines and len(lines) != allowed.get(name, (0, ""))[0]:
            found.append(f"{name} touches the environment at lines {lines}")
    return found


def test_only_launch_code_reads_the_environment() -> None:
    """A new environment read outside kiln/launch/ fails here: put the setting in the config, move the read behind
    kiln/launch/environment/variables.py, or (where the user names the variable) list it in ENV_READS with why."""
    assert env_offenders() == []


def test_the_environment_check_sees_every_form(tmp_path: Path) -> None:
    package = tmp_path / "kiln" / "engine"
    package.mkdir(parents=True)
    (package / "bad.py").write_text(
        "import os\nfrom os import getenv\n"
        "A = os.environ.get('A')\nB = getenv('B')\nos.environ.setdefault('C', '1')\nD = os.getenv('D')\n"
    )
    (package / "listed.py").write_text("import os\nA = os.environ['A']\n")
    (tmp_path / "kiln" / "launch").mkdir()
    (tmp_path / "kiln" / "launch" / "own.py").write_text("import os\nA = os.environ['A']\n")
    assert env_reads(package / "bad.py") == [2, 3, 5, 6]
    assert env_offenders(tmp_path / "kiln", {"kiln/engine/listed.py": (1, "named by the user")}) == [
        "kiln/engine/bad.py touches the environment at lines [2, 3, 5, 6]"
    ]
    assert env_offenders(tmp_path / "kiln", {}) == [
        "kiln/engine/bad.py touches the environment at lines [2, 3, 5, 6]",
        "kiln/engine/listed.py touches the environment at lines [2]",
    ]
