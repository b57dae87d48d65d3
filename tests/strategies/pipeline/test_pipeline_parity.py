"""The pipeline axis end to end (kiln/strategies/mesh/pipeline.py), on one spawned world of 2 gloo
processes, as `strategy: {name: model_parallel, mesh: {pp: 2}}` on a tiny Llama from a config:

- every schedule (GPipe, 1F1B, and with 2 stages a rank interleaved 1F1B, interleaved zero bubble and
  ZBV) gives the per-step losses and the final weights of `single` on the same global batch (windows of
  2 micro-batches whose item counts differ, and a short last window of 1), with SGD with momentum and
  global gradient clipping (the losses reach the first stage in the norm's all-reduce), and without
  clipping every rank logs the last stage's losses too (a broadcast of their own);
- batches of different lengths, left-padded with an attention mask (labels -100 on the padding): the
  window's micro-batches padded to one shape and the mask handed to every stage, 1F1B's losses and
  weights are single's on the same global batch (the loss counts the window's label tokens);
- each rank holds the stages' layers torch's schedule places on it (1 stage a rank: layers 0-1 with the
  embeddings, 2-3 with the norm and lm_head; loop style: 0 and 2 / 1 and 3; V: 0 and 3 with both ends /
  1 and 2), under the full model's names, and the saved model gathers every stage's weights on rank 0;
- evaluation (during training and called by hand) and prediction run the whole model stage to stage:
  eval losses and predicted logits equal single's;
- a checkpoint saved under pp 2 mid-run, by 1F1B (one stage a rank) and by interleaved 1F1B (two),
  resumes under pp 2 and ends bitwise equal to the run that never stopped, optimizer state included;
- `save.async` under pp 2 alone: 1F1B's checkpoints written on DCP's thread are complete, the run's
  losses, weights and momenta are the synchronous run's bit for bit, and its mid-run checkpoint
  resumes bitwise too; each resumes on one process
  (model_parallel without pp) too, within 1e-5 of single, and a one-process checkpoint resumes under
  pp 2 (zbv), ending equal to the run that never stopped; `kiln convert` makes a pp
  checkpoint a from_pretrained folder;
- a Trainer that overrides compute_loss is refused, naming where the pipeline's loss comes from.

Run as a script under torchrun, this file is the worker (`python -m torch.distributed.run ... THIS OUT ONE`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # the torchrun worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.helpers import dcp_writer_threads, momenta  # noqa: E402
from tests.strategies.pipeline.cases import LeftPadding, close, config, data, llama, ragged, train  # noqa: E402
from tests.world import run_world

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
#: the decoder layers each rank holds (and whether it holds the embeddings, and the norm and head)
LAYOUT = {
    "gpipe": [([0, 1], True, False), ([2, 3], False, True)],
    "1f1b": [([0, 1], True, False), ([2, 3], False, True)],
    "interleaved_1f1b": [([0, 2], True, False), ([1, 3], False, True)],
    "interleaved_zb": [([0, 2], True, False), ([1, 3], False, True)],
    "zbv": [([0, 3], True, True), ([1, 2], False, False)],
}
EVAL = {"eval": {"strategy": "steps", "steps": 2}, "per_device_eval_batch_size": 4}


def pp(schedule: str) -> dict:
    return {"name": "model_parallel", "device": "cpu", "mesh": {"pp": 2}, "pipeline": {"schedule": schedule}}


def worker(out: str, one_process_checkpoint: str) -> None:
    from kiln import Trainer
    from kiln.utils.errors import KilnError

    rank = int(os.environ["RANK"])
    results = {}
    for schedule in SCHEDULES:  # the later Trainers join the first one's process group
        extra = {**EVAL} if schedule == "1f1b" else {}
        if schedule in ("1f1b", "interleaved_1f1b"):  # one stage a rank, and two (0 and 2 / 1 and 3)
            extra["save"] = {"strategy": "steps", "steps": 2}
        extra["per_device_eval_batch_size"] = EVAL["per_device_eval_batch_size"]  # single's eval batches
        losses, state, trainer = train(
            os.path.join(out, schedule), pp(schedule), teardown=False, eval_dataset=data(6), **extra
        )
        evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
        results[schedule] = {"losses": losses, "state": state, "evals": evals, "momenta": momenta(trainer)}
        results[f"{schedule} export"] = trainer.strategy.model_state_for_export(trainer.model)  # {} off rank 0
        if schedule in ("1f1b", "zbv"):  # zbv: rank 1 runs stages 1 and 2 back to back, rank 0 both ends
            results[f"{schedule} evaluate"] = trainer.evaluate(data(6))["eval_loss"]
        if schedule == "1f1b":
            results["predict"] = trainer.predict(data(6)).predictions

    # save.async under pp 2 alone: the 1F1B run again, its checkpoints written on DCP's thread
    with dcp_writer_threads() as writers:
        async_save = {"strategy": "steps", "steps": 2, "async": True}
        losses, state, trainer = train(os.path.join(out, "1f1b async"), pp("1f1b"), teardown=False, save=async_save)
    results["1f1b async"] = {"losses": losses, "state": state, "momenta": momenta(trainer)}
    results["async writers"] = sorted(set(writers))

    # mid-run checkpoints resumed under pp 2: three of these pp runs, and one written by one process
    for name, schedule, checkpoint in (
        ("pp resumed", "1f1b", os.path.join(out, "1f1b", "checkpoint-2")),
        ("async resumed", "1f1b", os.path.join(out, "1f1b async", "checkpoint-2")),
        ("interleaved resumed", "interleaved_1f1b", os.path.join(out, "interleaved_1f1b", "checkpoint-2")),
        ("one-process resumed", "zbv", one_process_checkpoint),
    ):
        losses, state, trainer = train(os.path.join(out, name), pp(schedule), teardown=False, resume=checkpoint)
        results[name] = {"losses": losses, "state": state, "momenta": momenta(trainer)}

    # without clipping, the losses reach the first stage by a broadcast (with it, in the norm's all-reduce)
    results["unclipped"] = train(os.path.join(out, "unclipped"), pp("gpipe"), max_grad_norm=0.0)[0]

    # micro-batches of different lengths, left-padded: the real tokens see past the padding by the mask alone
    padding = LeftPadding()
    results["padded"] = train(os.path.join(out, "padded"), pp("1f1b"), train_dataset=ragged(), data_collator=padding)[
        :2
    ]
    results["padded lengths"] = padding.lengths

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = OwnLoss(llama(), config(os.path.join(out, "refused"), pp("1f1b")), train_dataset=data())
    try:
        trainer.fit()
        results["refused"] = ""
    except KilnError as err:
        results["refused"] = str(err)
    trainer.teardown()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_pipeline_schedules_equal_single_evaluate_and_resume_across_meshes(tmp_path):
    from kiln.engine.checkpoint.convert import convert_checkpoint
    from kiln.engine.checkpoint.files import why_damaged
    from kiln.engine.checkpoint.integrity import read_marker

    # a one-process run (model_parallel without pp) whose checkpoint-2 the world resumes under pp 2
    one_mesh = {"name": "model_parallel", "device": "cpu"}
    one_losses, one_state, _ = train(str(tmp_path / "one"), one_mesh, save={"strategy": "steps", "steps": 2})
    one_state = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in one_state.items()}  # DTensors of one rank
    run_world(__file__, tmp_path, tmp_path / "one" / "checkpoint-2", timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    want_losses, want, single = train(
        str(tmp_path / "single"), {"name": "single", "device": "cpu"}, teardown=False, eval_dataset=data(6), **EVAL
    )
    assert len(want_losses) == 4  # three windows of two micro-batches, then one of one
    want_evals = [e["eval_loss"] for e in single.state.log_history if "eval_loss" in e]
    want_eval, want_predictions = single.evaluate(data(6))["eval_loss"], single.predict(data(6)).predictions
    single.teardown()
    assert len(want_evals) == 2
    close(one_state, want, "the one-process run")

    layers = lambda state: sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})  # noqa: E731
    for schedule in SCHEDULES:
        states = [rank[schedule]["state"] for rank in ranks]
        for state, (held, embeddings, head) in zip(states, LAYOUT[schedule]):
            assert layers(state) == held, schedule
            assert ("model.embed_tokens.weight" in state) is embeddings, schedule
            assert ("lm_head.weight" in state) is head and ("model.norm.weight" in state) is head, schedule
        assert not set(states[0]) & set(states[1])
        close({**states[0], **states[1]}, want, schedule)
        for rank in ranks:  # the last stage's losses, sent to the other
            torch.testing.assert_close(rank[schedule]["losses"], want_losses, rtol=1e-5, atol=1e-5)
        exported = ranks[0][f"{schedule} export"]  # the saved model: every stage's weights on rank 0
        assert ranks[1][f"{schedule} export"] == {}
        close(exported, want, f"{schedule} export")

    unclipped = [rank["unclipped"] for rank in ranks]  # rank 0 holds no loss: rank 1's were sent to it
    assert len(unclipped[0]) == 4 and unclipped[0] == unclipped[1]
    torch.testing.assert_close(unclipped[0][0], want_losses[0], rtol=1e-5, atol=1e-5)  # no update yet

    # left-padded micro-batches whose lengths differ within a window: single's losses and weights
    padding = LeftPadding()
    want_padded, want_padded_state, _ = train(
        str(tmp_path / "single padded"),
        {"name": "single", "device": "cpu"},
        train_dataset=ragged(),
        data_collator=padding,
    )
    assert [rank["padded lengths"] for rank in ranks] == [padding.lengths] * 2
    assert len(padding.lengths) == 8 and padding.lengths[0::2] != padding.lengths[1::2]
    for rank in ranks:
        torch.testing.assert_close(rank["padded"][0], want_padded, rtol=1e-5, atol=1e-5)
    close({**ranks[0]["padded"][1], **ranks[1]["padded"][1]}, want_padded_state, "padded")

    for rank in ranks:  # evaluation runs the whole model, stage to stage, on every rank
        torch.testing.assert_close(rank["1f1b"]["evals"], want_evals, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank["1f1b evaluate"], want_eval, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank["zbv evaluate"], want_eval, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            torch.as_tensor(rank["predict"]), torch.as_tensor(want_predictions), rtol=1e-5, atol=1e-5
        )
        assert "OwnLoss.compute_loss" in rank["refused"] and "loss_function" in rank["refused"]

    # save.async under pp 2 alone: every checkpoint complete (COMPLETE, every digest), written by DCP's thread
    for step in (2, 4):
        checkpoint = str(tmp_path / "1f1b async" / f"checkpoint-{step}")
        assert why_damaged(checkpoint) is None and read_marker(checkpoint)["format"] == "fsdp-sharded"
    assert [rank["async writers"] for rank in ranks] == [["AsyncCheckpointExecutor_0"]] * 2

    # the async run, and the runs resumed under pp 2 from step 2 (one stage a rank, and two; the first
    # from the async run's checkpoint): bit for bit the synchronous pp runs that never stopped, optimizer
    # state (each stage's momenta) included; the one-process run
    for rank in ranks:
        for name, schedule in (
            ("1f1b async", "1f1b"),
            ("pp resumed", "1f1b"),
            ("async resumed", "1f1b"),
            ("interleaved resumed", "interleaved_1f1b"),
        ):
            resumed, uninterrupted = rank[name], rank[schedule]
            assert resumed["losses"] == uninterrupted["losses"], name  # steps 1-2 from the checkpoint's log
            for part in ("state", "momenta"):
                assert sorted(resumed[part]) == sorted(uninterrupted[part]) != [], f"{name}: {part}"
                for key, value in resumed[part].items():
                    assert torch.equal(value, uninterrupted[part][key]), f"{name}: {part} {key} is not bitwise equal"
        torch.testing.assert_close(rank["one-process resumed"]["losses"], one_losses, rtol=1e-5, atol=1e-5)
    close(
        {**ranks[0]["one-process resumed"]["state"], **ranks[1]["one-process resumed"]["state"]}, one_state, "one → pp"
    )

    # checkpoint-2 of the 1f1b run (two stages) and of the interleaved run (four, two a rank, each rank's
    # optimizer param groups listing its stages' names out of the model's order): one model each, which
    # one process resumes
    for schedule in ("1f1b", "interleaved_1f1b"):
        checkpoint = str(tmp_path / schedule / "checkpoint-2")
        losses, _, trainer = train(str(tmp_path / f"resumed {schedule}"), one_mesh, teardown=False, resume=checkpoint)
        resumed = trainer.strategy.model_state_for_export(trainer.model)
        trainer.teardown()
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5)
        close(resumed, want, f"{schedule} → one process")

    # the last checkpoint as a from_pretrained folder: the whole model, the weights the run ended with
    convert_checkpoint(str(tmp_path / "1f1b" / "checkpoint-4"), str(tmp_path / "hf"), None)
    from transformers import LlamaForCausalLM

    close(LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict(), want, "converted")


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
