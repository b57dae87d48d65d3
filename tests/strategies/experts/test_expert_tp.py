"""The expert axis beside tp, `mesh: {ep: 2, tp: 2}` (kiln/strategies/mesh/expert_parallel.py), on a real
world of 4 gloo processes (heavy), on the tiny Mixtral of cases.py: the experts of each MoE layer split
over ep ({0, 2} and {1, 3}: each ep rank a data shard), attention and the head split by the model's own
tensor-parallel plan over tp ({0, 1} and {2, 3}: the ranks of one data shard), the router, norms and
embeddings whole.

Its per-step losses, logged gradient norms (clipping is global: max_grad_norm 0.3 clips every step) and
final weights equal `single` on the same global batch within 1e-5; `evaluate` equals single's; each rank
holds experts 2e and 2e+1 (e: its ep rank) and its tp half of the attention; tokens per expert reach
the loggers; a mid-run checkpoint resumes under the same mesh bitwise (losses and every rank's local
tensors) equal to the run that never stopped, and a later one on one process (`model_parallel` without
ep or tp) ends on single's weights within 1e-5. With bf16 (autocast), the first step's loss is single
bf16's within 1e-4, the later losses within 2e-4 and the weights within 1e-3 (bf16's rounding of tp's
split products: see the test), and differ from the float32 run's.

Run by `run_world`, this file is the worker (`python THIS OUT`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if __name__ == "__main__":  # the world's worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.strategies.experts.cases import (  # noqa: E402
    EVAL_BATCH,
    assert_ranks_follow_single,
    assert_resumes,
    data,
    grad_norms,
    local_state,
    moe,
    single_reference,
    train,
)
from tests.world import run_world  # noqa: E402

EP_TP = {"name": "model_parallel", "device": "cpu", "mesh": {"ep": 2, "tp": 2}}
SAVE = {"save": {"strategy": "steps", "steps": 1}}
LOG = {"history": ["jsonl"], "disable_tqdm": True, "steps": 1}


def worker(out: str) -> None:
    rank = int(os.environ["RANK"])
    losses, state, trainer = train(os.path.join(out, "run"), EP_TP, teardown=False, log=LOG, **SAVE, **EVAL_BATCH)
    model = trainer.model
    results: dict[str, Any] = {
        "losses": losses,
        "norms": grad_norms(trainer),
        "export": state,
        "local": local_state(model),
        "placements": {
            k: [repr(p) for p in v.placements] for k, v in model.state_dict().items() if hasattr(v, "placements")
        },
        "evaluate": trainer.evaluate(data(5))["eval_loss"],
    }
    checkpoint = os.path.join(out, "run", "checkpoint-1")
    losses, _, trainer = train(
        os.path.join(out, "resumed"), EP_TP, model=moe(seed=1), teardown=False, resume=checkpoint
    )
    results["resumed"] = {"losses": losses, "local": local_state(trainer.model)}
    # bf16 autocast: the tp-split layers' DTensor matmuls and the experts' rows in bf16, the weights float32
    losses, state, _ = train(os.path.join(out, "bf16"), EP_TP, bf16=True)
    results["bf16"] = {"losses": losses, "export": state}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.heavy
@pytest.mark.distributed
def test_ep_x_tp_equals_single_clips_globally_and_resumes_bitwise(tmp_path):
    run_world(__file__, tmp_path, nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    # the same global batch on one process: 2 data shards of micro-batches of 2
    reference = single_reference(str(tmp_path / "single"))
    assert_ranks_follow_single(ranks, reference)
    want = reference[1]
    full = want["model.layers.0.mlp.experts.gate_up_proj"]
    for r, rank in enumerate(ranks):
        e = r // 2  # the ep rank: experts 2e and 2e + 1, the same on both tp ranks
        local = rank["local"]["model.layers.0.mlp.experts.gate_up_proj"]
        torch.testing.assert_close(local, full[2 * e : 2 * e + 2], rtol=1e-5, atol=1e-5)
        placements = rank["placements"]
        assert placements["model.layers.0.mlp.experts.gate_up_proj"] == ["Shard(dim=0)"]  # over ep
        assert placements["model.layers.0.self_attn.q_proj.weight"] == ["Shard(dim=0)"]  # over tp
        assert placements["model.layers.1.self_attn.o_proj.weight"] == ["Shard(dim=1)"]
        assert "model.layers.0.mlp.gate.weight" not in placements  # the router whole
        assert placements["model.embed_tokens.weight"] == ["Shard(dim=0)"]  # the vocabulary over tp
    lines = [json.loads(x) for x in (tmp_path / "run" / "runs" / "metrics.jsonl").read_text().splitlines()]
    balance = [x for x in lines if "moe/tokens_per_expert_mean" in x]  # counted over ep, once per data shard
    assert [x["moe/tokens_per_expert_mean"] for x in balance] == [8 * 10 * 2 / 4, 8 * 10 * 2 / 4, 4 * 10 * 2 / 4]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ranks[0]["local"][q], ranks[1]["local"][q])  # tp halves differ
    assert torch.equal(ranks[0]["local"][q], ranks[2]["local"][q])  # the ep ranks' replicas equal

    # bf16 autocast: the first step's loss (the same weights) is single bf16's within 1e-4 (measured 4.2e-5).
    # Not float32's noise, as pp x dp_shard gets: tp's row-split layers round each rank's partial product to
    # bf16 before the all-reduce sums them, where single rounds one product, so the two differ by bf16's
    # rounding of those activations -- on this tiny model as much as bf16 moves the loss from float32
    # (2.7e-5). So that the check is not met by a float32 run, the run's losses must differ from its own
    # float32 losses (autocast on: measured 1.6e-5 to 1.4e-4 apart; float32 repeats bit for bit). Later
    # losses within 2e-4 (measured 4.4e-5), the weights within 1e-3 (measured 1.7e-4; bf16 moves them
    # 1.5e-4 from float32).
    bf16_losses, bf16, _ = train(
        str(tmp_path / "single bf16"), {"name": "single", "device": "cpu"}, bf16=True, per_device_train_batch_size=4
    )
    for r, rank in enumerate(ranks):
        got_bf16 = rank["bf16"]["losses"]
        assert got_bf16[0] == pytest.approx(bf16_losses[0], rel=0, abs=1e-4), f"rank {r}"
        torch.testing.assert_close(got_bf16, bf16_losses, rtol=0, atol=2e-4, msg=f"rank {r} bf16 losses")
        assert max(abs(a - b) for a, b in zip(got_bf16, rank["losses"])) > 1e-5, f"rank {r}: bf16 did not run"
    assert sorted(ranks[0]["bf16"]["export"]) == sorted(bf16)
    for name, value in bf16.items():
        torch.testing.assert_close(ranks[0]["bf16"]["export"][name], value, rtol=0, atol=1e-3, msg=f"bf16 {name}")
    assert all(rank["bf16"]["export"] == {} for rank in ranks[1:])

    assert_resumes(ranks, str(tmp_path / "run"), str(tmp_path / "one"), want)


if __name__ == "__main__":
    worker(sys.argv[1])
