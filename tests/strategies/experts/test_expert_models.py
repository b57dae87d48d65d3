"""Heavy: ep 2 on Qwen3-MoE, OLMoE and DeepSeek-V3 (a dense first layer, then routed experts beside a
shared expert, group-limited routing) gives the per-step losses and final weights of `single` on the
same global batch, on one spawned world of 2 gloo processes (test_expert_parity.py runs Mixtral in the
default suite); and on 4 processes, ep 2 within dp_shard 4 (each expert FSDP-sharded over the 2 ranks
that hold it) does too on Mixtral, and its last DCP checkpoint converts to the same weights. Run as a script
under torchrun, this file is the worker (`... THIS OUT [4]`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.strategies.experts.cases import train  # noqa: E402
from tests.world import run_world

KINDS = ("qwen3_moe", "olmoe", "deepseek_v3")


def worker_4(out: str) -> None:
    strategy = {"name": "model_parallel", "device": "cpu", "mesh": {"dp_shard": 4, "ep": 2}}
    save = {"strategy": "steps", "steps": 3}
    losses, state, trainer = train(os.path.join(out, "ep"), strategy, per_device_train_batch_size=1, save=save)
    torch.save({"losses": losses, "state": state}, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


def worker(out: str) -> None:
    strategy = {"name": "model_parallel", "device": "cpu", "mesh": {"ep": 2}}
    results = {}
    for kind in KINDS:
        losses, state, trainer = train(os.path.join(out, kind), strategy, kind=kind, teardown=False)
        results[kind] = {"losses": losses, "state": state}
    trainer.teardown()
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


@pytest.mark.heavy
@pytest.mark.distributed
def test_expert_parallel_equals_single_on_other_moe_families(tmp_path):
    run_world(__file__, tmp_path, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = {"name": "single", "device": "cpu"}
    for kind in KINDS:
        want_losses, want, _ = train(str(tmp_path / kind), single, kind=kind, per_device_train_batch_size=4)
        for rank in ranks:
            torch.testing.assert_close(rank[kind]["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=kind)
        got = ranks[0][kind]["state"]
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"{kind}: {name} differs")


@pytest.mark.heavy
@pytest.mark.distributed
def test_ep_2_within_dp_shard_4_equals_single(tmp_path):
    from kiln.engine.checkpoint.convert import convert_checkpoint

    run_world(__file__, tmp_path, 4, nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    want_losses, want, _ = train(
        str(tmp_path / "single"), {"name": "single", "device": "cpu"}, per_device_train_batch_size=4
    )
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], want_losses, rtol=1e-5, atol=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    # the experts' 2-D shards (dp_shard_mod_ep x ep) of the last step's DCP checkpoint, as one model
    convert_checkpoint(str(tmp_path / "ep" / "checkpoint-3"), str(tmp_path / "hf"), None)
    from transformers import MixtralForCausalLM

    loaded = MixtralForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-5, msg=f"converted: {name}")


if __name__ == "__main__":
    worker_4(sys.argv[1]) if sys.argv[2:] == ["4"] else worker(sys.argv[1])
