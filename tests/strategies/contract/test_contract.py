"""The strategy contract suite: every strategy that can run here either gives the same numbers as
`single` for each scenario (fit, evaluate, predict, resume, export, auto batch size, full-eval) or
refuses it in the Trainer's constructor, exactly where its declared capabilities say it cannot.

A new strategy joins by adding one entry to STRATEGIES below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.strategies import STRATEGIES as REGISTRY
from tests.strategies.contract.fakes import OwnStepStrategy, SpmdSizesStrategy
from tests.strategies.contract.scenarios import SCENARIOS, run_all
from tests.world import run_world

HERE = Path(__file__).resolve().parent

#: id -> (strategy as the Trainer takes it, processes, tolerance against `single`)
STRATEGIES = {
    "ddp": ("ddp", 2, 1e-5),
    "fsdp": ("fsdp", 2, 1e-5),
    "model_parallel": ("model_parallel", 2, 1e-5),  # its default mesh: dp_shard over both processes
    "model_parallel_tp": (
        "model_parallel_tp",
        2,
        1e-5,
    ),  # tp 2 with a plan (tests/strategies/model_parallel/contract_tp.py)
    "deepspeed": ("deepspeed", 2, 1e-5),  # ZeRO-2
    "deepspeed_stage_3": ("deepspeed_stage_3", 2, 1e-5),
    "fake_own_step": (OwnStepStrategy, 1, 0.0),
    "fake_spmd": (SpmdSizesStrategy, 1, 0.0),
    "two_d": ("two_d", 2, 1e-5),  # tests/strategies/plugins/two_d.py: a plug-in from outside kiln/
}

#: strategies whose ranks do not each read their own data (tensor parallelism: one data shard for both)
DATA_SHARDS = {"model_parallel_tp": 1}

#: scenario -> the capability that allows it (None: every strategy must run it)
NEEDS = {"auto_batch_size": "auto_batch_size", "full_eval": "full_eval_cast"}


def _start(keys: list[str], out: Path) -> list[str]:
    """One 2-process world running every strategy in `keys` (worker.py); [why it failed], or []."""
    entries = [f"{STRATEGIES[k][0]}={DATA_SHARDS.get(k, 2)}" for k in keys]
    proc = run_world(HERE / "worker.py", out, *entries, timeout=1200, check=False)
    if proc.returncode != 0:
        return [f"contract worker for {keys} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"]
    return []


@pytest.fixture(scope="module")
def multi_process(request, tmp_path_factory):
    """key -> OUT of its results: the multi-process strategies this session selected, all in one world
    started on first use (a world per strategy cost its start-up and first fit's imports five times)."""
    out = tmp_path_factory.mktemp("multi_process")
    wanted = [
        item.callspec.params["key"]
        for item in request.session.items
        if item.originalname == "test_strategy_matches_single_or_refuses_up_front" and item.path == request.path
    ]
    keys = [k for k in STRATEGIES if k in wanted and STRATEGIES[k][1] == 2]
    failed: list[str] = []  # the world's failure, given to every test that reads it (not started again)

    def get(key: str) -> Path:
        if not (out / "started").exists():
            (out / "started").touch()
            failed.extend(_start(keys, out))
        if failed:
            pytest.fail(failed[0])
        return out / STRATEGIES[key][0]

    return get


def _run(key: str, multi_process, tmp_path: Path) -> tuple[dict, dict]:
    strategy, world, _ = STRATEGIES[key]
    if world == 1:
        return run_all(strategy, str(tmp_path), 1)
    from safetensors.torch import load_file

    folder = multi_process(key)
    results = json.loads((folder / "results.json").read_text())
    if "error" in results:
        pytest.fail(f"{key} failed in the contract worker:\n{results['error']}")
    return results, load_file(str(folder / "tensors.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    results, tensors = run_all("single", str(tmp_path_factory.mktemp("single")), 1)
    assert not any("refused" in r for r in results.values()), results  # single supports every scenario
    return results, tensors


def _capabilities(strategy):
    return (REGISTRY.get(strategy) if isinstance(strategy, str) else strategy).capabilities


def _close(a, b, tol: float) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(b)) + (1e-7 if tol else 0.0)
    return a == b


#: in `-m heavy` only (CI time): model_parallel's default mesh is FSDP over every rank (`fsdp` and
#: `model_parallel_tp` stay); ZeRO-2 (`deepspeed_stage_3` stays; stage 0-3 parity: test_deepspeed_strategy.py)
_HEAVY = {"model_parallel", "deepspeed"}


@pytest.mark.distributed
@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.heavy) if k in _HEAVY else k for k in STRATEGIES])
def test_strategy_matches_single_or_refuses_up_front(key, reference, multi_process, tmp_path):
    strategy, _, tol = STRATEGIES[key]
    ref_results, ref_tensors = reference
    results, tensors = _run(key, multi_process, tmp_path)
    caps = _capabilities(strategy)
    for scenario in SCENARIOS:
        got = results[scenario]
        capability = NEEDS.get(scenario)
        if capability is not None and not getattr(caps, capability):
            assert "refused" in got, f"{key}: {scenario} ran although its capabilities say it cannot"
            assert key in got["refused"] or "strategy" in got["refused"]
            continue
        assert "refused" not in got, f"{key}: {scenario} was refused: {got}"
        want = ref_results[scenario]
        for field, value in want.items():
            assert _close(got[field], value, tol), f"{key}: {scenario}.{field} = {got[field]} but single gives {value}"
        for name, ref in ref_tensors.items():
            if name.startswith(f"{scenario}/"):
                assert name in tensors, f"{key}: {scenario} did not produce {name}"
                torch.testing.assert_close(
                    tensors[name], ref, rtol=tol, atol=tol, msg=f"{key}: {name} differs from single"
                )


def test_every_runnable_registered_strategy_is_in_the_suite():
    """A strategy that can run on this machine must join the contract suite (one line above)."""
    runnable_here = {"single", "ddp", "fsdp", "deepspeed"}
    implemented = set()
    for name in runnable_here:
        try:
            implemented.add(REGISTRY.get(name).name)
        except Exception:  # not written yet (UnknownNameError), or its package is missing
            continue
    assert implemented - {"single"} <= set(STRATEGIES), (
        f"add {sorted(implemented - set(STRATEGIES) - {'single'})} to STRATEGIES"
    )
