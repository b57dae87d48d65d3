"""The pipeline axis with FSDP2 beside it, `mesh: {pp: 2, dp_shard: 2}` (kiln/strategies/mesh/pipeline.py):

- one rank of a fake 4-process world (torch's fake process group: every collective a no-op, the mesh,
  the stages and FSDP2 real), in this process: each rank's stage layers, its dp_shard and pp groups,
  its data shard, and every parameter it holds sharded over its stage's dp_shard ranks;
- heavy: a real world of 4 gloo processes (tests/world.py), 1F1B and ZBV, whose per-step losses and
  final weights equal `single` on the same global batch; 1F1B saves in the background (`save.async`),
  and its mid-run checkpoint resumes under the same mesh bitwise and on one process (`model_parallel`
  without pp) equal to single; the last checkpoint of each, converted by `kiln convert`, holds exactly
  the weights the run exported; with bf16 the first step's loss is single bf16's within 2e-6, and the
  later losses and the weights within bf16's rounding (2e-3);
- heavy, each in a world of its own: GPipe, interleaved 1F1B, interleaved ZB (ZB1P) and ZBV over windows
  of 4 micro-batches, whose losses and final weights equal single's (with a window of 2, ZB1P never runs
  a rank's other stage between one stage's input and weight backwards: a window of 4 does).

Run by `run_world`, this file is the worker (`python THIS OUT [SCHEDULE]`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

if __name__ == "__main__":  # the world's worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.strategies.pipeline.cases import close, data, llama, train  # noqa: E402
from tests.world import run_world  # noqa: E402

MESH = {"pp": 2, "dp_shard": 2}
#: one global batch: 2 data shards x windows of 2 micro-batches of 1 under pp x dp_shard, and windows of 2
#: micro-batches of 2 on one process (the same 4 samples a step: 22 samples are 5 steps, then one of 2)
PP_DP_BATCH, ONE_BATCH = {"per_device_train_batch_size": 1}, {"per_device_train_batch_size": 2}
EVAL = {"eval": {"strategy": "steps", "steps": 3}, "per_device_eval_batch_size": 3}
#: rank -> (its stage's decoder layers, embeddings, norm and head, its dp_shard group, its pp group)
LAYOUT = {
    0: ([0, 1], True, False, [0, 1], [0, 2]),
    3: ([2, 3], False, True, [2, 3], [1, 3]),
}


def pp_dp(schedule: str) -> dict:
    return {"name": "model_parallel", "device": "cpu", "mesh": MESH, "pipeline": {"schedule": schedule}}


def test_each_rank_of_a_fake_world_holds_its_stage_sharded_over_its_dp_shard_ranks(caplog):
    """Rank 3 (stage 1, dp_shard rank 1), then rank 0 (stage 0, dp_shard rank 0), in this order: DTensor
    caches its plans by mesh, and the equal mesh of a second fake world would find the first one's groups,
    so only the first world runs DTensor's collectives (the clipping)."""
    for rank in (3, 0):
        _fake_rank(rank, clip=rank == 3, caplog=caplog)


def _fake_rank(rank: int, *, clip: bool, caplog: Any) -> None:
    import torch.distributed as dist
    from omegaconf import read_write
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies.model_parallel.strategy import ModelParallelPipeline

    held, embeddings, head, dp_group, pp_group = LAYOUT[rank]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        # built for this 1-process launch, then given the mesh: the group made here decides the world
        cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu"}, "gradient_accumulation_steps": 2})
        strategy = ModelParallelPipeline(cfg, build_precision(cfg))
        with read_write(cfg):
            cfg.strategy.options.mesh = MESH
        with caplog.at_level("INFO", logger="kiln.strategies.mesh.pipeline"):
            model = strategy.setup_module(llama())
        mesh = strategy.device_mesh
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and mesh.shape == (2, 1, 2, 1, 1)
        groups = [dist.get_process_group_ranks(g) for g in (mesh["dp_shard"].get_group(), strategy.pp_group)]
        assert groups == [dp_group, pp_group] and strategy._dp_group is mesh["dp_shard"].get_group()
        facts = (strategy.pp_rank, strategy.data_shards, strategy.data_shard_rank, strategy.item_shards)
        assert facts == (rank // 2, 2, rank % 2, 2) and strategy.grad_divisor == 2  # FSDP's mean over dp_shard
        state = model.state_dict()
        assert sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")}) == held
        assert ("model.embed_tokens.weight" in state) is embeddings and ("lm_head.weight" in state) is head
        ends = ", the embeddings" if embeddings else ", the final norm and lm_head"
        assert (
            f"rank {rank // 2} of the pipeline holds stage(s) {rank // 2} (decoder layers {held[0]}-{held[-1]}){ends}"
            in caplog.text
        )
        (forward,) = strategy.stage_forwards  # the root unit: the module torch's stage syncs gradients of
        assert isinstance(forward, FSDPModule) and strategy._stages[0].submod is forward
        # only the stage's forward is ever called (the schedule, ChainedForward): none of direct_calls.py's
        # hooks on it (FSDP's own alone) nor on its decoder view and head, which cost calls a micro-batch
        hooks = [*forward._forward_pre_hooks.values(), *forward._forward_hooks.values()]
        assert all("FSDPState" in repr(hook) for hook in hooks), hooks
        for module in (forward.decoder, forward.head):
            assert module is None or not (module._forward_pre_hooks or module._forward_hooks), type(module)
        for i in held:
            unit = model.model.layers[str(i)] if hasattr(model.model.layers, "keys") else model.model.layers[i]
            assert isinstance(unit, FSDPModule)
            assert unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None  # gathered until backward
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp_shard",), name
            assert [repr(x) for x in p.placements] == ["Shard(dim=0)"], name
            assert p.to_local().shape[0] == -(-p.shape[0] // 2) or rank % 2, name  # the first half on dp rank 0

        # the no-op collectives leave each rank's own values: a sum is this rank's, a mean half of it
        assert strategy.reduce(torch.tensor(6.0), "sum") == 6.0 and strategy.reduce(torch.tensor(6.0), "mean") == 3.0
        # the window's item count: summed at once on the last stage's ranks (its losses' weights), and only
        # when read on the others (stage 0 never reads it)
        calls: list[int] = []
        real = dist.all_reduce
        with mock.patch.object(dist, "all_reduce", side_effect=lambda *a, **k: (calls.append(1), real(*a, **k))[1]):
            wait = strategy.reduce_async(torch.tensor(5), "sum")
            started = len(calls)
            assert wait() == 5
        assert (started, len(calls)) == ((0, 1) if rank == 0 else (1, 1))
        if not clip:
            strategy.teardown()
            return
        for p in model.parameters():
            p.grad = DTensor.from_local(torch.full_like(p.to_local(), 2.0), p.device_mesh, p.placements)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        norm = strategy.clip_gradients(model, optimizer, max_norm=1.0)
        local = sum(p.to_local().numel() for p in model.parameters())
        # the norm of the 4 ranks' shards (clip.py's one all-gather, whose fake hands every rank's place this
        # rank's norms: 4 ranks holding these shards)
        torch.testing.assert_close(norm, torch.tensor(4 * 4.0 * local).sqrt())
        for p in model.parameters():  # every shard scaled by max_norm / norm
            torch.testing.assert_close(p.grad.to_local(), torch.full_like(p.to_local(), 2.0 / float(norm)))
        strategy.teardown()
    finally:
        dist.destroy_process_group()


#: windows of 4 micro-batches (2 data shards x 4 of 1, single 4 of 2): 22 samples are 2 steps, then one of 3
WINDOW4 = {"gradient_accumulation_steps": 4}


def one_schedule(out: str, schedule: str) -> None:
    """One schedule's run alone, over windows of 4: its losses, and the model gathered on rank 0."""
    losses, _, trainer = train(os.path.join(out, schedule), pp_dp(schedule), teardown=False, **PP_DP_BATCH, **WINDOW4)
    export = trainer.strategy.model_state_for_export(trainer.model)
    torch.save({"losses": losses, "export": export}, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


def worker(out: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from tests.helpers import dcp_writer_threads

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for schedule in ("1f1b", "zbv"):  # the later Trainers join the first one's process group
        # 1F1B saves in the background (DCP's async_save), ZBV in the step
        save = {"strategy": "steps", "steps": 2, "async": schedule == "1f1b"}
        extra = {**PP_DP_BATCH, "save": save, **(EVAL if schedule == "1f1b" else {})}
        with dcp_writer_threads() as writers:  # the threads that write DCP's shard files (fit waits for them)
            losses, state, trainer = train(
                os.path.join(out, schedule), pp_dp(schedule), teardown=False, eval_dataset=data(6), **extra
            )
        evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]  # during training
        evaluated = trainer.evaluate(data(6))["eval_loss"]
        units = [*trainer.model.modules(), *trainer.strategy.stage_forwards]
        groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units if isinstance(unit, FSDPModule)]
        # nothing is left gathered after an evaluation (a root may hold no parameters: no group)
        resharded = [group.is_sharded for group in groups if group is not None]
        results[schedule] = {"losses": losses, "export": trainer.strategy.model_state_for_export(trainer.model)}
        results[schedule].update(resharded=resharded, evaluated=evaluated, evals=evals, writers=sorted(set(writers)))
        if schedule == "1f1b":
            results[schedule]["state"] = {k: v.to_local().clone() for k, v in state.items()}  # this rank's shards
    checkpoint = os.path.join(out, "1f1b", "checkpoint-2")
    losses, state, _ = train(
        os.path.join(out, "resumed"), pp_dp("1f1b"), teardown=False, resume=checkpoint, **PP_DP_BATCH
    )
    results["resumed"] = {"losses": losses, "state": {k: v.to_local().clone() for k, v in state.items()}}
    # bf16 autocast in every stage (the stages' forwards), FSDP's shards and reductions in float32
    losses, _, trainer = train(os.path.join(out, "bf16"), pp_dp("1f1b"), teardown=False, bf16=True, **PP_DP_BATCH)
    results["bf16"] = {"losses": losses, "export": trainer.strategy.model_state_for_export(trainer.model)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.heavy
@pytest.mark.distributed
def test_pp_x_dp_shard_equals_single_and_its_checkpoint_resumes_bitwise_and_on_one_process(tmp_path):
    run_world(__file__, tmp_path, nproc=4, timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    single = {"name": "single", "device": "cpu"}
    want_losses, want, trainer = train(
        str(tmp_path / "single"), single, teardown=False, eval_dataset=data(6), **EVAL, **ONE_BATCH
    )
    want_evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    want_evaluated = trainer.evaluate(data(6))["eval_loss"]
    trainer.teardown()
    assert len(want_losses) == 6 and len(want_evals) == 2
    for rank in ranks:  # evaluation during training runs the sharded stages stage to stage, then reshards them
        torch.testing.assert_close(rank["1f1b"]["evals"], want_evals, rtol=1e-5, atol=1e-5)
        for schedule in ("1f1b", "zbv"):  # an evaluation called by hand, then nothing left gathered
            torch.testing.assert_close(rank[schedule]["evaluated"], want_evaluated, rtol=1e-5, atol=1e-5)
            assert len(rank[schedule]["resharded"]) >= 2 and all(rank[schedule]["resharded"]), schedule

    for schedule in ("1f1b", "zbv"):
        for rank in ranks:  # each data shard's losses, averaged over dp_shard as the loop logs them
            torch.testing.assert_close(rank[schedule]["losses"], want_losses, rtol=1e-5, atol=1e-5)
        close(ranks[0][schedule]["export"], want, f"{schedule}: the saved model, gathered on rank 0")
        assert all(rank[schedule]["export"] == {} for rank in ranks[1:])

    for rank in ranks:  # 1F1B's checkpoints written by DCP's background thread, ZBV's in the step
        assert rank["1f1b"]["writers"] == ["AsyncCheckpointExecutor_0"] and rank["zbv"]["writers"] == ["MainThread"]

    # resumed from step 2 under the same mesh: bit for bit the run that never stopped, shard by shard
    for r, rank in enumerate(ranks):
        resumed, uninterrupted = rank["resumed"], rank["1f1b"]
        assert resumed["losses"] == uninterrupted["losses"]
        assert sorted(resumed["state"]) == sorted(uninterrupted["state"])
        for name, value in resumed["state"].items():
            assert torch.equal(value, uninterrupted["state"][name]), f"rank {r}: {name} is not bitwise equal"

    # bf16: the first step's loss (the same weights, every matmul in autocast's bf16) is single bf16's
    # within float32's noise, and far from the float32 run's; later steps and the weights within bf16's
    # rounding (each shard's weight gradient is a bf16 matmul over its own samples, then summed, where
    # single rounds one matmul over all of them: measured 3e-4 on the losses, 2e-4 on the weights, about
    # what bf16 moves them from the float32 run)
    bf16_losses, bf16, _ = train(str(tmp_path / "single bf16"), single, bf16=True, **ONE_BATCH)
    assert abs(bf16_losses[0] - want_losses[0]) > 1e-5
    for rank in ranks:
        assert rank["bf16"]["losses"][0] == pytest.approx(bf16_losses[0], rel=0, abs=2e-6)
        torch.testing.assert_close(rank["bf16"]["losses"], bf16_losses, rtol=0, atol=2e-3)
    for name, value in bf16.items():
        torch.testing.assert_close(ranks[0]["bf16"]["export"][name], value, rtol=0, atol=2e-3, msg=name)
    assert all(rank["bf16"]["export"] == {} for rank in ranks[1:])

    # the last checkpoint of each run (1F1B's written in the background) as a from_pretrained folder:
    # the weights the run exported
    from transformers import LlamaForCausalLM

    from kiln.engine.checkpoint.convert import convert_checkpoint

    for schedule in ("1f1b", "zbv"):
        convert_checkpoint(str(tmp_path / schedule / "checkpoint-6"), str(tmp_path / f"hf {schedule}"), None)
        converted = LlamaForCausalLM.from_pretrained(tmp_path / f"hf {schedule}").state_dict()
        assert sorted(converted) == sorted(ranks[0][schedule]["export"]), schedule
        for name, value in converted.items():
            assert torch.equal(value, ranks[0][schedule]["export"][name]), f"{schedule} converted: {name}"

    # the same checkpoint on one process (model_parallel without pp): its two sharded stages are one model
    one_mesh = {"name": "model_parallel", "device": "cpu"}
    checkpoint = str(tmp_path / "1f1b" / "checkpoint-2")
    losses, _, trainer = train(str(tmp_path / "one"), one_mesh, teardown=False, resume=checkpoint, **ONE_BATCH)
    resumed = trainer.strategy.model_state_for_export(trainer.model)
    trainer.teardown()
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5)
    close(resumed, want, "pp x dp_shard → one process")


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b", "interleaved_zb", "zbv"])
def test_each_schedule_beside_dp_shard_equals_single_over_windows_of_4(tmp_path, schedule):
    run_world(__file__, tmp_path, schedule, nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    single = {"name": "single", "device": "cpu"}
    want_losses, want, _ = train(str(tmp_path / "single"), single, **ONE_BATCH, **WINDOW4)
    assert len(want_losses) == 3
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=f"rank {r} losses")
    close(ranks[0]["export"], want, f"{schedule} x dp_shard: the saved model, gathered on rank 0")
    assert all(rank["export"] == {} for rank in ranks[1:])


if __name__ == "__main__":
    if len(sys.argv) > 2:
        one_schedule(sys.argv[1], sys.argv[2])
    else:
        worker(sys.argv[1])
