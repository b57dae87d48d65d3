"""The 2-process and 1-process model_parallel worlds that test_model_parallel.py and test_loaded_tp.py both
read (each world costs its processes' start-up): session-scoped, and the two files share an xdist group."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.strategies.case_jobs import start
from tests.strategies.model_parallel import cases

HERE = Path(__file__).resolve().parent


def torchrun(nproc: int, out: Path, *names: str) -> tuple[dict, dict]:
    return start(HERE / "worker.py", out, list(names), timeout=900, nproc=nproc)


def checkpoint(out: Path, case: str, step: int = 2) -> Path:
    return out / "runs" / case / f"checkpoint-{step}"


@pytest.fixture(scope="session")
def tp_two(tmp_path_factory):
    """(results, weights, OUT) of tp 2, configure_model, dp_shard 2 and a model transformers split at load."""
    out = tmp_path_factory.mktemp("mp_two")
    cases.llama().save_pretrained(cases.saved_llama(str(out / "runs")))  # what loaded_tp2 loads
    return (*torchrun(2, out, "tp2", "hook", "dp2", "loaded_tp2"), out)


@pytest.fixture(scope="session")
def tp_one(tp_two, tmp_path_factory):
    """On one process: the tp-2 checkpoint resumed, model_parallel's own run (checkpoints every 2 steps), and
    the checkpoint of the model split at load resumed."""
    out = tmp_path_factory.mktemp("mp_one")
    tp2, loaded = checkpoint(tp_two[2], "tp2"), checkpoint(tp_two[2], "loaded_tp2")
    return (*torchrun(1, out, f"resume={tp2}", "one", f"resume_from_loaded={loaded}"), out)
