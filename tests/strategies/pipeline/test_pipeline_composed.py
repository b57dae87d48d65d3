"""The pipeline axis beside tp and beside dp_replicate (kiln/strategies/mesh/pipeline.py), each on a real
world of 4 gloo processes (heavy):

- `mesh: {pp: 2, tp: 2}`: each stage split by kiln's tensor-parallel plan (the model's own, `tp_plan:
  auto`) over its tp ranks, the stages' activations sent over the pp groups ({0, 2} and {1, 3});
- `mesh: {pp: 2, dp_replicate: 2}`: replicas of the pipeline (FSDP2's HSDP with shards of one rank), each
  replica reading its own data shard, gradients all-reduced over dp_replicate once per window.

For each, with 1F1B: the per-step losses, the logged gradient norms (clipping is global: max_grad_norm
0.3 clips every step) and the final weights equal `single` on the same global batch within 1e-5;
evaluation during training and called by hand equals single's; a mid-run checkpoint resumes under the
same mesh bitwise (losses and every rank's local tensors) equal to the run that never stopped, and on
one process (`model_parallel` without pp) within 1e-5 of single. ZBV's losses and weights equal
single's too, and under pp x tp so do GPipe's and interleaved 1F1B's (two stages a rank, each split over
tp), and under pp x tp and pp x dp_replicate interleaved ZB's over windows of 4 micro-batches (where ZB1P
runs a rank's other stage between one stage's input and weight backwards), each in a world of its own.

Run by `run_world`, this file is the worker (`python THIS OUT MESH [SCHEDULE [WINDOW]]`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if __name__ == "__main__":  # the world's worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.strategies.pipeline.cases import close, data, train  # noqa: E402
from tests.world import run_world  # noqa: E402

MESHES = {"tp": {"pp": 2, "tp": 2}, "dp_replicate": {"pp": 2, "dp_replicate": 2}}
#: one global batch a step, in windows of 2 micro-batches: under pp x tp one data shard, of micro-batches
#: of 3 as single's (22 samples: 3 steps, then one of 1 micro-batch); under pp x dp_replicate two data
#: shards of micro-batches of 1 each, and single's of 2 (5 steps, then one of 1)
BATCH = {"tp": {"per_device_train_batch_size": 3}, "dp_replicate": {"per_device_train_batch_size": 1}}
SINGLE_BATCH = {"tp": {"per_device_train_batch_size": 3}, "dp_replicate": {"per_device_train_batch_size": 2}}
STEPS = {"tp": 4, "dp_replicate": 6}
EVAL = {"eval": {"strategy": "steps", "steps": 2}, "per_device_eval_batch_size": 3}
SAVE = {"save": {"strategy": "steps", "steps": 2}}


def strategy(mesh: str, schedule: str = "1f1b") -> dict:
    return {"name": "model_parallel", "device": "cpu", "mesh": MESHES[mesh], "pipeline": {"schedule": schedule}}


def _local(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in state.items()}


def _norms(trainer: Any) -> list[float]:
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


def worker(out: str, mesh: str, schedule: str | None = None, window: str = "2") -> None:
    rank = int(os.environ["RANK"])
    batch = {**BATCH[mesh], "gradient_accumulation_steps": int(window)}
    if schedule is not None:  # one schedule's run alone: its losses and the model gathered on rank 0
        losses, _, trainer = train(os.path.join(out, schedule), strategy(mesh, schedule), teardown=False, **batch)
        export = trainer.strategy.model_state_for_export(trainer.model)
        torch.save({"losses": losses, "export": export}, os.path.join(out, f"rank{rank}.pt"))
        return
    losses, state, trainer = train(
        os.path.join(out, "run"), strategy(mesh), teardown=False, eval_dataset=data(6), **batch, **EVAL, **SAVE
    )
    results: dict[str, Any] = {
        "losses": losses,
        "norms": _norms(trainer),
        "evals": [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e],
        "evaluated": trainer.evaluate(data(6))["eval_loss"],
        "state": _local(state),
        "placements": {k: [repr(p) for p in v.placements] for k, v in state.items() if hasattr(v, "placements")},
        "export": trainer.strategy.model_state_for_export(trainer.model),
    }
    checkpoint = os.path.join(out, "run", "checkpoint-2")
    losses, state, trainer = train(
        os.path.join(out, "resumed"), strategy(mesh), teardown=False, resume=checkpoint, **batch
    )
    results["resumed"] = {"losses": losses, "state": _local(state)}
    # zero bubble in a V (each backward split into its input and weight halves, 2 stages a rank)
    losses, _, trainer = train(os.path.join(out, "zbv"), strategy(mesh, "zbv"), teardown=False, **batch)
    results["zbv"] = {"losses": losses, "export": trainer.strategy.model_state_for_export(trainer.model)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def _check(tmp_path: Path, mesh: str) -> None:
    run_world(__file__, tmp_path, mesh, nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    single = {"name": "single", "device": "cpu"}
    want_losses, want, trainer = train(
        str(tmp_path / "single"), single, teardown=False, eval_dataset=data(6), **EVAL, **SINGLE_BATCH[mesh]
    )
    want_norms = _norms(trainer)
    want_evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    want_evaluated = trainer.evaluate(data(6))["eval_loss"]
    trainer.teardown()
    assert (
        len(want_losses) == STEPS[mesh] and len(want_evals) == STEPS[mesh] // 2 and min(want_norms) > 0.3
    )  # every step clips

    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=f"rank {r} losses")
        torch.testing.assert_close(rank["norms"], want_norms, rtol=1e-5, atol=1e-5, msg=f"rank {r} grad norms")
        torch.testing.assert_close(rank["evals"], want_evals, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank["evaluated"], want_evaluated, rtol=1e-5, atol=1e-5)
    close(ranks[0]["export"], want, f"pp x {mesh}: the saved model, gathered on rank 0")
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["zbv"]["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=f"rank {r} zbv")
    close(ranks[0]["zbv"]["export"], want, f"pp x {mesh}, zbv")
    assert all(rank["export"] == {} for rank in ranks[1:])

    if mesh == "tp":  # each stage's split layers are DTensors sharded over tp, the rest whole
        stage0, stage1 = ranks[0]["placements"], ranks[3]["placements"]
        assert stage0["model.layers.0.self_attn.q_proj.weight"] == ["Shard(dim=0)"]
        assert stage0["model.layers.1.mlp.down_proj.weight"] == ["Shard(dim=1)"]
        assert stage1["lm_head.weight"] == ["Shard(dim=0)"] and "model.embed_tokens.weight" not in stage1
        assert "model.norm.weight" not in stage1 and "model.layers.0.self_attn.q_proj.weight" not in stage1
        for a, b in ((0, 1), (2, 3)):  # a tp pair: the same names, the split halves differ
            assert sorted(ranks[a]["state"]) == sorted(ranks[b]["state"])
            q = "model.layers.0.self_attn.q_proj.weight" if a == 0 else "model.layers.2.self_attn.q_proj.weight"
            assert not torch.equal(ranks[a]["state"][q], ranks[b]["state"][q])
    else:  # each replica holds its stage whole, and the replicas are equal
        for a, b in ((0, 1), (2, 3)):
            assert sorted(ranks[a]["state"]) == sorted(ranks[b]["state"])
            for name, value in ranks[a]["state"].items():
                assert torch.equal(value, ranks[b]["state"][name]), name

    # the same checkpoint on one process (model_parallel without pp): the stages' pieces are one model
    one_mesh = {"name": "model_parallel", "device": "cpu"}
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    losses, _, trainer = train(str(tmp_path / "one"), one_mesh, teardown=False, resume=checkpoint, **SINGLE_BATCH[mesh])
    resumed = trainer.strategy.model_state_for_export(trainer.model)
    trainer.teardown()
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5)
    close(resumed, want, f"pp x {mesh} → one process")

    for r, rank in enumerate(ranks):  # resumed from step 2 under the same mesh: bit for bit, tensor by tensor
        resumed = rank["resumed"]
        assert resumed["losses"] == rank["losses"], f"rank {r}"
        assert sorted(resumed["state"]) == sorted(rank["state"])
        for name, value in resumed["state"].items():
            assert torch.equal(value, rank["state"][name]), f"rank {r}: {name} is not bitwise equal"


@pytest.mark.heavy
@pytest.mark.distributed
def test_pp_x_tp_equals_single_clips_globally_and_resumes_bitwise(tmp_path):
    _check(tmp_path, "tp")


@pytest.mark.heavy
@pytest.mark.distributed
def test_pp_x_dp_replicate_equals_single_clips_globally_and_resumes_bitwise(tmp_path):
    _check(tmp_path, "dp_replicate")


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_pp_x_tp_schedule_equals_single(tmp_path, schedule):
    run_world(__file__, tmp_path, "tp", schedule, nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    single = {"name": "single", "device": "cpu"}
    want_losses, want, _ = train(str(tmp_path / "single"), single, **SINGLE_BATCH["tp"])
    assert len(want_losses) == STEPS["tp"]
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=f"rank {r} {schedule}")
    close(ranks[0]["export"], want, f"pp x tp, {schedule}: the saved model, gathered on rank 0")
    assert all(rank["export"] == {} for rank in ranks[1:])


@pytest.mark.heavy
@pytest.mark.distributed
def test_pp_x_tp_interleaved_zb_equals_single_over_windows_of_4(tmp_path):
    """ZB1P's split backward (input, then weight halves, a rank's other stage run between them) on stages
    split over tp: the weight half's gradients of DTensor parameters are those of one process."""
    run_world(__file__, tmp_path, "tp", "interleaved_zb", "4", nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    single = {"name": "single", "device": "cpu"}
    want_losses, want, _ = train(str(tmp_path / "single"), single, **SINGLE_BATCH["tp"], gradient_accumulation_steps=4)
    assert len(want_losses) == 2  # 22 samples: 8 micro-batches of 3 (the last of 1), two windows of 4
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=f"rank {r}")
    close(ranks[0]["export"], want, "pp x tp, interleaved_zb: the saved model, gathered on rank 0")
    assert all(rank["export"] == {} for rank in ranks[1:])


@pytest.mark.heavy
@pytest.mark.distributed
def test_pp_x_dp_replicate_interleaved_zb_equals_single_over_windows_of_4(tmp_path):
    run_world(__file__, tmp_path, "dp_replicate", "interleaved_zb", "4", nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    single = {"name": "single", "device": "cpu"}
    want_losses, want, _ = train(
        str(tmp_path / "single"), single, **SINGLE_BATCH["dp_replicate"], gradient_accumulation_steps=4
    )
    assert len(want_losses) == 3  # 22 samples: 2 windows of 8, then one of 6
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=f"rank {r}")
    close(ranks[0]["export"], want, "pp x dp_replicate, interleaved_zb: the saved model, gathered on rank 0")
    assert all(rank["export"] == {} for rank in ranks[1:])


if __name__ == "__main__":
    worker(*sys.argv[1:])
