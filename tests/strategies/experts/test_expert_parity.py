"""The expert axis end to end (kiln/strategies/mesh/expert_parallel.py, experts.py), on one spawned
world of 2 gloo processes, as `strategy: {name: model_parallel, mesh: {ep: 2}}` and
`{dp_shard: 2, ep: 2}` (ep within dp_shard: the rest FSDP-sharded) on a tiny Mixtral from a config
(4 experts, 2 per token):

- each gives the per-step losses and the final weights of `single` on the same global batch (windows
  of 2 micro-batches whose item counts differ, then a short window of 1), with SGD with momentum and
  global gradient clipping; rank r holds experts 2r and 2r+1 of each layer (its local shard equals
  those rows of the trained weights);
- evaluation during fit (ep) and `evaluate` called by hand (both) give single's eval losses, on 5
  samples of one per batch (the second rank's last batch repeats a sample); `predict` with
  predict_with_generate gives single's generated token ids, though the ranks' sequences of one batch
  end at different steps;
- tokens per expert reach the loggers on every logging step (all routed pairs: tokens x top-k);
- with the router's auxiliary loss (`output_router_logits`, `router_aux_loss_coef`), ep 2 equals
  DDP on the same 2 processes: each rank's auxiliary loss on its own tokens, summed (HF's counting);
- the ep run's checkpoint of step 1 resumed on the ep mesh ends bitwise on the weights and momenta of
  the run that never stopped;
- `save.async` under ep 2: the checkpoints written on DCP's thread are complete, the run's losses,
  weights and momenta are the synchronous run's bit for bit, and its step-1 checkpoint resumes bitwise;
- a `full` checkpoint (DDP on the same 2 processes, step 2) resumes under ep 2, optimizer state
  included, ending within 1e-5 of the ep run that never stopped (DDP's first steps reduce in another
  order); its checkpoint of step 2 resumed as dp_shard 2 (in the world) and on one process (in
  the test) ends on single's weights; `kiln convert` makes the last one a from_pretrained folder whose
  logits are the trained model's.

Run as a script under torchrun, this file is the worker (`python -m torch.distributed.run ... THIS OUT`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # the torchrun worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.helpers import dcp_writer_threads, momenta  # noqa: E402
from tests.strategies.experts.cases import data, moe, train  # noqa: E402
from tests.world import run_world

EP = {"name": "model_parallel", "device": "cpu", "mesh": {"ep": 2}}
EP_IN_DP = {"name": "model_parallel", "device": "cpu", "mesh": {"dp_shard": 2, "ep": 2}}
DP_SHARD = {"name": "model_parallel", "device": "cpu", "mesh": {"dp_shard": 2}}
DDP = {"name": "ddp", "device": "cpu"}
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
#: evaluation during fit after every step, one sample a batch (so each batch's loss is one sample's on
#: any number of ranks); 5 samples, so the second rank's last batch repeats one (kiln's eval sampler)
EVAL = {"eval": {"strategy": "steps", "steps": 1}, "per_device_eval_batch_size": 1}
#: `predict` generates (greedy, up to 6 tokens): a quarter of the vocabulary ends a sequence, so the two
#: ranks' sequences of one batch stop at different steps (checked below)
GENERATE = {
    "predict_with_generate": True,
    "generation_kwargs": {"max_new_tokens": 6, "do_sample": False, "eos_token_id": list(range(0, 128, 4))},
}
EVAL["eval"].update(GENERATE)


def eval_losses(trainer) -> list[float]:
    return [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]


def worker(out: str) -> None:
    rank = int(os.environ["RANK"])
    results: dict = {}
    log = {"history": ["jsonl"], "disable_tqdm": True, "steps": 1}
    save = {"strategy": "steps", "steps": 1}
    losses, state, trainer = train(
        os.path.join(out, "ep"), EP, teardown=False, save=save, log=log, eval_dataset=data(5), **EVAL
    )
    experts = trainer.model.model.layers[0].mlp.experts
    results["ep"] = {
        "losses": losses,
        "state": state,
        "local": experts.gate_up_proj.to_local().detach().clone(),
        "eval": eval_losses(trainer),
        "evaluate": trainer.evaluate(data(5))["eval_loss"],
        "generated": torch.as_tensor(trainer.predict(data(5)).predictions),
        "momenta": momenta(trainer),
    }
    # save.async under ep 2: the ep run again, its checkpoints written on DCP's thread
    with dcp_writer_threads() as writers:
        async_save = {**save, "async": True}
        losses, state, trainer = train(os.path.join(out, "ep async"), EP, teardown=False, save=async_save)
    results["ep async"] = {"losses": losses, "state": state, "momenta": momenta(trainer)}
    results["async writers"] = sorted(set(writers))
    # a single/DDP (`full`) checkpoint: DDP on the same 2 processes (the same data shards), saved at step 2
    ddp_save = {"strategy": "steps", "steps": 2}
    losses, state, trainer = train(os.path.join(out, "ddp"), DDP, teardown=False, save=ddp_save)
    results["ddp"] = {"losses": losses, "state": state}
    # ep borrowed from dp_shard: everything else sharded by FSDP2
    losses, state, trainer = train(
        os.path.join(out, "ep in dp_shard"), EP_IN_DP, teardown=False, per_device_eval_batch_size=1
    )
    experts = trainer.model.model.layers[0].mlp.experts
    results["ep in dp_shard"] = {
        "losses": losses,
        "state": state,
        "local": experts.gate_up_proj.to_local().detach().clone(),
        "evaluate": trainer.evaluate(data(5))["eval_loss"],
    }
    # the ep run's checkpoints resumed: on the ep mesh from step 1, and as dp_shard 2 from step 2; the
    # async run's from step 1 and DDP's `full` one from step 2, on the ep mesh
    for name, strategy, run, step in (
        ("ep resumed", EP, "ep", 1),
        ("dp_shard resumed", DP_SHARD, "ep", 2),
        ("async resumed", EP, "ep async", 1),
        ("full resumed", EP, "ddp", 2),
    ):
        resume = os.path.join(out, run, f"checkpoint-{step}")
        losses, state, trainer = train(
            os.path.join(out, name), strategy, model=moe(seed=1), resume=resume, teardown=False
        )
        results[name] = {"losses": losses, "state": state, "momenta": momenta(trainer)}
    for name, strategy in (("aux ep", EP), ("aux ddp", DDP)):
        losses, state, trainer = train(os.path.join(out, name), strategy, model=moe(**AUX), teardown=False)
        results[name] = {"losses": losses, "state": state}
    trainer.teardown()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_expert_parallel_equals_single_and_resumes_on_one_process(tmp_path):
    from kiln import Trainer
    from kiln.engine.checkpoint.convert import convert_checkpoint
    from kiln.engine.checkpoint.files import why_damaged
    from kiln.engine.checkpoint.integrity import read_marker
    from tests.strategies.experts.cases import config

    # ~25 s; a generate that hangs (mismatched all-to-alls) fails in minutes, not ten
    run_world(__file__, tmp_path, timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    # the same global batch on one process: micro-batches of 2 x 2
    want_losses, want, single = train(
        str(tmp_path / "single"),
        {"name": "single", "device": "cpu"},
        per_device_train_batch_size=4,
        eval_dataset=data(5),
        teardown=False,
        **EVAL,
    )
    want_eval, want_evaluate = eval_losses(single), single.evaluate(data(5))["eval_loss"]
    want_generated = torch.as_tensor(single.predict(data(5)).predictions)
    single.teardown()
    assert len(want_losses) == 3 and len(want_eval) == 3  # two windows of two micro-batches, then one of one
    full = want["model.layers.0.mlp.experts.gate_up_proj"]
    for run in ("ep", "ep in dp_shard"):
        got = ranks[0][run]
        assert ranks[1][run]["state"] == {} and sorted(got["state"]) == sorted(want)  # the export gathers to rank 0
        for name, value in want.items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-5, msg=f"{run}: {name} differs")
        for r, rank in enumerate(ranks):  # rank r's shard: experts 2r, 2r + 1
            torch.testing.assert_close(rank[run]["losses"], want_losses, rtol=1e-5, atol=1e-5, msg=run)
            torch.testing.assert_close(rank[run]["local"], full[2 * r : 2 * r + 2], rtol=1e-5, atol=1e-5, msg=run)
            assert rank[run]["evaluate"] == pytest.approx(want_evaluate, rel=1e-5, abs=1e-6), run
        assert [rank["ep"]["eval"] for rank in ranks] == [pytest.approx(want_eval, rel=1e-5, abs=1e-6)] * 2
    assert want_evaluate != pytest.approx(want_eval[0], rel=1e-3)  # trained between the two

    # generation (predict_with_generate) under ep: single's token ids on every rank, though in the last
    # batch rank 0's sequence (sample 2) ended before rank 1's (sample 0): the rank that stopped kept
    # running the experts' all-to-alls until the other had ended too
    lengths = (want_generated != -100).sum(1).tolist()  # the prompt's 10 tokens, then what was generated
    assert lengths[2] != lengths[0] and len(set(lengths)) > 1, lengths
    for rank in ranks:
        assert torch.equal(torch.as_tensor(rank["ep"]["generated"]), want_generated)

    # save.async under ep 2: every checkpoint complete (COMPLETE, every digest), written by DCP's thread
    for step in (1, 2, 3):
        checkpoint = str(tmp_path / "ep async" / f"checkpoint-{step}")
        assert why_damaged(checkpoint) is None and read_marker(checkpoint)["format"] == "fsdp-sharded"
    assert [rank["async writers"] for rank in ranks] == [["AsyncCheckpointExecutor_0"]] * 2
    # the async run, and the runs resumed on the ep mesh from step 1 of the sync and the async run: bitwise
    # the sync run that never stopped (the weights gathered on rank 0; each rank's momenta, expert shards too)
    got = ranks[0]["ep"]["state"]
    for name in ("ep async", "ep resumed", "async resumed"):
        assert sorted(ranks[0][name]["state"]) == sorted(got)
        assert [key for key, value in got.items() if not torch.equal(ranks[0][name]["state"][key], value)] == [], name
        for rank in ranks:
            assert rank[name]["losses"] == rank["ep"]["losses"], name
            assert sorted(rank[name]["momenta"]) == sorted(rank["ep"]["momenta"]) != [], name
            for key, value in rank["ep"]["momenta"].items():
                assert torch.equal(rank[name]["momenta"][key], value), f"{name}: momentum of {key}"
    # from its step 2 as dp_shard 2: its expert shards become FSDP shards of another mesh
    for name, value in want.items():
        torch.testing.assert_close(ranks[0]["dp_shard resumed"]["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)

    # DDP's `full` checkpoint of step 2 resumed under ep 2 (translated: the full weights and momenta sharded
    # over ep): the ep run's last step from DDP's weights and momenta. Within 1e-5, not bitwise: DDP's first
    # two steps all-reduce the experts' gradients where ep sums each expert's tokens after its all-to-all,
    # so the step-2 state differs from the ep run's in float rounding; without the momenta it would not
    # come within 1e-5
    assert read_marker(str(tmp_path / "ddp" / "checkpoint-2"))["format"] == "full"
    for r, rank in enumerate(ranks):
        resumed = rank["full resumed"]
        assert resumed["losses"][:2] == rank["ddp"]["losses"][:2]  # steps 1-2 from the checkpoint's log
        torch.testing.assert_close(resumed["losses"], rank["ep"]["losses"], rtol=1e-5, atol=1e-5)
        assert sorted(resumed["momenta"]) == sorted(rank["ep"]["momenta"]) != []
        for key, value in rank["ep"]["momenta"].items():
            torch.testing.assert_close(resumed["momenta"][key], value, rtol=1e-5, atol=1e-5, msg=f"rank {r}: {key}")
    for name, value in got.items():
        torch.testing.assert_close(ranks[0]["full resumed"]["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(ranks[0]["ddp"]["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)

    lines = [json.loads(x) for x in (tmp_path / "ep" / "runs" / "metrics.jsonl").read_text().splitlines()]
    balance = [x for x in lines if "moe/tokens_per_expert_mean" in x]
    assert [x["step"] for x in balance] == [1, 2, 3]
    # every token (10 a sample, padding included) routed to 2 of 4 experts: 8 samples a full step, then 4
    assert [x["moe/tokens_per_expert_mean"] for x in balance] == [8 * 10 * 2 / 4, 8 * 10 * 2 / 4, 4 * 10 * 2 / 4]
    for x in balance:
        assert x["moe/tokens_per_expert_min"] <= x["moe/tokens_per_expert_mean"] <= x["moe/tokens_per_expert_max"]
        assert (
            x["moe/tokens_per_expert_imbalance"]
            >= x["moe/tokens_per_expert_max"] / x["moe/tokens_per_expert_mean"] - 1e-9
        )

    aux, ddp = ranks[0]["aux ep"], ranks[0]["aux ddp"]
    torch.testing.assert_close(aux["losses"], ddp["losses"], rtol=1e-5, atol=1e-5)
    assert abs(aux["losses"][0] - want_losses[0]) > 1e-3  # the auxiliary loss is in it
    for name, value in ddp["state"].items():
        torch.testing.assert_close(aux["state"][name], value, rtol=1e-5, atol=1e-5, msg=f"aux: {name} differs")

    # checkpoint-2 of the ep run: its expert shards are one model, which one process resumes
    model = moe(seed=1)
    cfg = config(str(tmp_path / "resumed"), {"name": "model_parallel", "device": "cpu"}, per_device_train_batch_size=4)
    trainer = Trainer(model, cfg, train_dataset=data())
    trainer.fit(resume_from_checkpoint=str(tmp_path / "ep" / "checkpoint-2"))
    resumed = trainer.strategy.model_state_for_export(trainer.model)
    trainer.teardown()
    for name, value in want.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-5, msg=f"resumed: {name} differs")

    # the last checkpoint as a from_pretrained folder: its logits are the trained model's
    convert_checkpoint(str(tmp_path / "ep" / "checkpoint-3"), str(tmp_path / "hf"), None)
    from transformers import MixtralForCausalLM

    loaded = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = moe().eval()
    trained.load_state_dict(got)
    ids = torch.stack([b["input_ids"] for b in data(4)])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)


if __name__ == "__main__":
    worker(sys.argv[1])
