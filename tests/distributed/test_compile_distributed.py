"""Compiled training on 2 processes (gloo): under DDP (torch.compile of the DDP module) and FSDP2
(each block compiled before fully_shard, as torchtitan does) kiln compiles the graphs, and breaks
as often, as the hand-written loop on every rank; nothing recompiles in the second epoch; and the
weights are those of the same run uncompiled. A tiny two-block model by default; a 2-layer GPT-2
with `-m heavy` (tracing GPT-2 four times per process takes minutes on 2 cores)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.distributed

CASES = ("ddp", "fsdp")


def _run(tmp_path_factory, model: str) -> list[dict]:
    out = tmp_path_factory.mktemp(f"compile_{model}")
    torchrun("worker_compile.py", out, model, *CASES, timeout=900)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _run(tmp_path_factory, "blocks")


def _assert_same_rule(ranks: list[dict], case: str) -> None:
    for result in ranks:
        got = result[case]
        assert got["kiln"] == got["hand"] and got["kiln"]["graphs"] > 0
        steps, evals = got["seen"]["steps"], got["seen"]["evals"]
        assert len(steps) == 4 and len(evals) == 2  # 2 windows x 2 epochs, an evaluation after each epoch
        assert steps[2:] == [evals[0]] * 2 and evals == [got["kiln"]["graphs"]] * 2  # epoch 2 compiles nothing
    got = ranks[0][case]
    assert got["weights"] > 0 and got["max_diff"] <= 1e-5  # the uncompiled run's weights


@pytest.mark.parametrize("case", CASES)
def test_same_graphs_and_breaks_as_the_hand_written_loop_and_the_uncompiled_weights(ranks, case):
    _assert_same_rule(ranks, case)
    if case == "fsdp":  # one graph per block and mode: FSDP's hooks stay outside, no break between blocks
        assert ranks[0][case]["kiln"]["breaks"] == 0


def test_ddp_compiles_the_ddp_module_and_fsdp_its_blocks(ranks):
    assert ranks[0]["ddp"]["seen"]["wrapped"] == "OptimizedModule"
    assert ranks[0]["fsdp"]["seen"]["wrapped"] != "OptimizedModule"  # the root stays eager; its blocks are compiled


@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES)
def test_gpt2_same_rule(tmp_path_factory, case, _gpt2_cache={}):  # noqa: B006 -- one job for both cases
    if "ranks" not in _gpt2_cache:
        _gpt2_cache["ranks"] = _run(tmp_path_factory, "gpt2")
    _assert_same_rule(_gpt2_cache["ranks"], case)
