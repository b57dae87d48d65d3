"""The expert axis beside dp_replicate, `mesh: {dp_replicate: 2, ep: 2}` (kiln/strategies/mesh/expert_parallel.py),
on a real world of 4 gloo processes (heavy), on the tiny Mixtral of cases.py: two replicas ({0, 1} and {2, 3}),
each splitting the experts of every MoE layer over its two ranks (ep groups {0, 1} and {2, 3}; ranks 0 and 2 hold
experts 0-1, ranks 1 and 3 experts 2-3), everything else whole on every rank, every rank a data shard.

Its per-step losses, logged gradient norms (clipping is global: max_grad_norm 0.3 clips every step) and
final weights equal `single` on the same global batch within 1e-5; `evaluate` equals single's; each rank
holds experts 2e and 2e+1 (e: its ep rank), the same values as the rank holding them in the other
replica; tokens per expert reach the loggers, counted over all four ranks; a mid-run checkpoint resumes
under the same mesh bitwise (losses and every rank's local tensors) equal to the run that never stopped,
and a later one on another mesh, ep 2 alone (a world of 2 processes: the replicas' experts become one ep
group's) and one process (`model_parallel` without ep), ends on single's weights within 1e-5; `kiln
convert` makes the last checkpoint a from_pretrained folder whose logits are the trained model's.

Run by `run_world`, this file is the worker (`python THIS OUT [ep]`)."""

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

EP_DP = {"name": "model_parallel", "device": "cpu", "mesh": {"dp_replicate": 2, "ep": 2}}
EP = {"name": "model_parallel", "device": "cpu", "mesh": {"ep": 2}}
#: one sample a micro-batch on each of the 4 data shards: 8 samples a step, so 20 samples make 3 steps
BATCH = {"per_device_train_batch_size": 1}
SAVE = {"save": {"strategy": "steps", "steps": 1}}
LOG = {"history": ["jsonl"], "disable_tqdm": True, "steps": 1}
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def worker(out: str, mesh: str = "ep x dp_replicate") -> None:
    rank = int(os.environ["RANK"])
    if mesh == "ep":  # checkpoint-2 of the 4-process run on ep 2 alone: micro-batches of 2, the same global batch
        resume = os.path.join(out, "run", "checkpoint-2")
        _, state, _ = train(
            os.path.join(out, "ep"), EP, model=moe(seed=1), resume=resume, per_device_train_batch_size=2
        )
        torch.save(state, os.path.join(out, f"ep{rank}.pt"))
        return
    losses, state, trainer = train(
        os.path.join(out, "run"), EP_DP, teardown=False, log=LOG, **BATCH, **SAVE, **EVAL_BATCH
    )
    model = trainer.model
    results: dict[str, Any] = {
        "losses": losses,
        "norms": grad_norms(trainer),
        "export": state,
        "local": local_state(model),
        "placements": {
            k: ([repr(p) for p in v.placements], v.device_mesh.mesh_dim_names)
            for k, v in model.state_dict().items()
            if hasattr(v, "placements")
        },
        "evaluate": trainer.evaluate(data(5))["eval_loss"],
    }
    checkpoint = os.path.join(out, "run", "checkpoint-1")
    losses, _, trainer = train(
        os.path.join(out, "resumed"), EP_DP, model=moe(seed=1), teardown=False, resume=checkpoint, **BATCH
    )
    results["resumed"] = {"losses": losses, "local": local_state(trainer.model)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.heavy
@pytest.mark.distributed
def test_ep_x_dp_replicate_equals_single_clips_globally_and_resumes_bitwise(tmp_path):
    run_world(__file__, tmp_path, nproc=4, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    # the same global batch on one process: 4 data shards of micro-batches of 1
    reference = single_reference(str(tmp_path / "single"))
    assert_ranks_follow_single(ranks, reference)
    want = reference[1]
    full = want[GATE_UP]
    for r, rank in enumerate(ranks):
        e = r % 2  # the ep rank: experts 2e and 2e + 1
        torch.testing.assert_close(rank["local"][GATE_UP], full[2 * e : 2 * e + 2], rtol=1e-5, atol=1e-5)
        placements = rank["placements"]
        assert placements[GATE_UP] == (["Shard(dim=0)"], ("ep",))  # over ep, within the replica
        assert sorted(placements) == sorted(k for k in want if ".mlp.experts." in k)  # the rest whole
    for r in (0, 1):  # the two replicas' ranks holding the same experts hold the same values, bit for bit
        other = ranks[r + 2]["local"]
        assert all(torch.equal(value, other[name]) for name, value in ranks[r]["local"].items()), f"rank {r}"
    assert torch.equal(ranks[0]["local"]["lm_head.weight"], ranks[1]["local"]["lm_head.weight"])
    assert not torch.equal(ranks[0]["local"][GATE_UP], ranks[1]["local"][GATE_UP])  # the ep halves differ
    lines = [json.loads(x) for x in (tmp_path / "run" / "runs" / "metrics.jsonl").read_text().splitlines()]
    balance = [x for x in lines if "moe/tokens_per_expert_mean" in x]  # counted over all four ranks, once each
    assert [x["moe/tokens_per_expert_mean"] for x in balance] == [8 * 10 * 2 / 4, 8 * 10 * 2 / 4, 4 * 10 * 2 / 4]

    assert_resumes(ranks, str(tmp_path / "run"), str(tmp_path / "one"), want)
    run_world(__file__, tmp_path, "ep", timeout=600)  # checkpoint-2 on ep 2 alone
    on_ep = [torch.load(tmp_path / f"ep{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(on_ep[0]) == sorted(want) and on_ep[1] == {}
    for name, value in want.items():
        torch.testing.assert_close(on_ep[0][name], value, rtol=1e-5, atol=1e-5, msg=f"resumed on ep 2: {name}")

    # the last checkpoint as a from_pretrained folder: its logits are the trained model's
    from transformers import MixtralForCausalLM

    from kiln.engine.checkpoint.convert import convert_checkpoint

    convert_checkpoint(str(tmp_path / "run" / "checkpoint-3"), str(tmp_path / "hf"), None)
    loaded = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = moe().eval()
    trained.load_state_dict(ranks[0]["export"])
    ids = torch.stack([b["input_ids"] for b in data(4)])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)


if __name__ == "__main__":
    worker(*sys.argv[1:])
