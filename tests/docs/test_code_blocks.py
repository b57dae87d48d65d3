"""Every fenced python / yaml / bash block of README.md and docs/*.md runs, on tiny sizes where its
marker says so (tests/docs/blocks.py; the rules are in docs/contributing.md). A page whose example
stops working, or a new block that cannot run and is not marked `not-run`, fails here."""

from __future__ import annotations

import contextlib
import io
import os
import shlex

import pytest

from tests.docs.blocks import REPO, Block, all_blocks
from tests.docs.standins import namespace

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.lang in ("python", "yaml", "bash") and "not-run" not in b.markers]


@pytest.fixture
def block_dir(tmp_path, monkeypatch):
    """A fresh cwd that sees the repository's examples/ (configs name them by path and import path)."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    namespace(tmp_path)  # writes the stand-in config.yaml that shell blocks name
    from kiln.loggers import LOGGERS
    from kiln.precision import PRECISIONS
    from kiln.strategies import STRATEGIES

    yield tmp_path
    for registry in (LOGGERS, PRECISIONS, STRATEGIES):  # a page that registers a plugin must not leak it
        for name, obj in list(registry._entries.items()):
            if not getattr(obj, "__module__", "").startswith("kiln."):
                del registry._entries[name]


def _run_python(block: Block, code: str, folder) -> None:
    # README's blocks are what a newcomer copies first: they run as they stand, with no stand-in objects
    ns = {"__name__": "__main__"} if block.page == "README.md" else namespace(folder)
    if "before" in block.markers:
        exec(compile(block.markers["before"], f"{block.id} (before)", "exec"), ns)
    exec(compile(code, block.id, "exec"), ns)


def _run_yaml(block: Block, code: str) -> None:
    import yaml

    from kiln import load_config

    load_config(yaml.safe_load(code) or {})


def _commands(code: str) -> list[list[str]]:
    """Shell lines (continuations joined, comments dropped) split at `&&` into argument lists."""
    joined = code.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                commands.append(words)
    return commands


def _kiln_argv(words: list[str]):
    if words[0] == "kiln":
        return words[1:]
    if words[:3] == ["python", "-m", "kiln.cli"]:
        return words[3:]
    return None


def _is_install(words: list[str]) -> bool:
    return words[0] == "pip" or words[:3] == ["python", "-m", "pip"]


def _run_bash(block: Block, code: str, folder) -> None:
    from kiln.cli import main

    if "before" in block.markers:
        exec(compile(block.markers["before"], f"{block.id} (before)", "exec"), namespace(folder))
    for words in _commands(code):
        if _is_install(words):
            continue  # the test environment is the installed one
        argv = _kiln_argv(words)
        assert argv is not None, (f"{block.id} runs {' '.join(words)!r}, which is not a kiln command: mark the block "
                                  "<!-- not-run: why --> and say why on the page")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                rc = main(argv)
            except SystemExit as exit_:
                rc = exit_.code
        assert not rc, f"{block.id}: `{' '.join(words)}` exited with {rc}:\n{out.getvalue()[-2000:]}"


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block: Block, block_dir):
    code = block.runnable_code()
    if block.lang == "python":
        _run_python(block, code, block_dir)
    elif block.lang == "yaml":
        _run_yaml(block, code)
    else:
        _run_bash(block, code, block_dir)


def test_every_block_is_run_or_says_why_not():
    """A block in a language that runs is run, or marked not-run with a reason of a few words; a
    block without a language must not hold a kiln command (it would escape the test)."""
    for block in BLOCKS:
        if "not-run" in block.markers:
            assert len(block.markers["not-run"].split()) >= 3, f"{block.id}: say why the block cannot run"
        if block.lang == "":  # ```text is a deliberate "shown, not run" (a synopsis with placeholders)
            kiln_lines = [w for w in _commands(block.code) if _kiln_argv(w)] if "kiln " in block.code else []
            assert not kiln_lines, f"{block.id}: a kiln command in a block without a language; make it ```bash"
