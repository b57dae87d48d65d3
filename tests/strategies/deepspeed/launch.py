"""Start this folder's 2-process worker chain (gloo on CPU): see conftest.py's `ds_world`."""

from __future__ import annotations

from pathlib import Path

from tests.world import run_world

HERE = Path(__file__).resolve().parent


def start(script: str, *args: str) -> None:
    """`script args...` on a 2-process world as torchrun starts it; a failure fails the test with its output."""
    run_world(HERE / script, *args, env={"DS_ACCELERATOR": "cpu"}, timeout=2400)
