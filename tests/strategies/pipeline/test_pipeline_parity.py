"""The pipeline axis end to end (kiln/strategies/mesh/pipeline.py), on one spawned world of 2 gloo
processes, as `strategy: {name: model_parallel, mesh: {pp: 2}}` on a tiny Llama from a config:

- GPipe and 1F1B each give the per-step losses and the final weights of `single` on the same global
  batch (windows of 2 micro-batches whose item counts differ, and a short last window of 1, which 1F1B
  runs in GPipe's order), with SGD with momentum and global gradient clipping;
- rank 0 holds the embeddings and decoder layers 0-1, rank 1 layers 2-3, the final norm and lm_head,
  under the full model's names, and the saved model gathers both stages' weights on rank 0;
- a checkpoint saved under pp 2 mid-run resumes on one process (model_parallel without pp) and ends
  equal to the run that never stopped; `kiln convert` makes it a from_pretrained folder;
- a Trainer that overrides compute_loss is refused, naming where the pipeline's loss comes from.

Run as a script under torchrun, this file is the worker (`python -m torch.distributed.run ... THIS OUT`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # the torchrun worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.strategies.pipeline.cases import config, data, llama, train  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def pp(schedule: str) -> dict:
    return {"name": "model_parallel", "device": "cpu", "mesh": {"pp": 2}, "pipeline": {"schedule": schedule}}


def worker(out: str) -> None:
    from kiln import Trainer
    from kiln.utils.errors import KilnError

    rank = int(os.environ["RANK"])
    results = {}
    for schedule in ("gpipe", "1f1b"):  # the later Trainers join the first one's process group
        save = {"strategy": "steps", "steps": 2} if schedule == "1f1b" else {"strategy": "no"}
        losses, state, trainer = train(os.path.join(out, schedule), pp(schedule), teardown=False, save=save)
        results[schedule] = {"losses": losses, "state": state}
        results[f"{schedule} export"] = trainer.strategy.model_state_for_export(trainer.model)  # {} off rank 0
    try:  # a stage's layers alone would predict garbage
        trainer.predict(data())
        results["predict"] = ""
    except KilnError as err:
        results["predict"] = str(err)

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
def test_pipeline_stages_equal_single_and_resume_on_one_process(tmp_path):
    from kiln import Trainer
    from kiln.engine.checkpoint.convert import convert_checkpoint

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"the pipeline job exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    want_losses, want, _ = train(str(tmp_path / "single"), {"name": "single", "device": "cpu"})
    assert len(want_losses) == 4  # three windows of two micro-batches, then one of one
    layers = lambda state: sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})  # noqa: E731
    for schedule in ("gpipe", "1f1b"):
        first, last = (rank[schedule]["state"] for rank in ranks)
        assert layers(first) == [0, 1] and layers(last) == [2, 3]
        assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
        assert {"model.norm.weight", "lm_head.weight"} <= set(last) and not {
            "model.norm.weight",
            "lm_head.weight",
        } & set(first)
        assert not set(first) & set(last) and sorted({**first, **last}) == sorted(want)
        for rank in ranks:  # the last stage's losses, broadcast to the first
            torch.testing.assert_close(rank[schedule]["losses"], want_losses, rtol=1e-5, atol=1e-5)
        for name, value in {**first, **last}.items():
            torch.testing.assert_close(
                value, want[name], rtol=1e-5, atol=1e-5, msg=f"{schedule}: {name} differs from single"
            )
        exported = ranks[0][f"{schedule} export"]  # the saved model: every stage's weights on rank 0
        assert ranks[1][f"{schedule} export"] == {} and sorted(exported) == sorted(want)
        for name, value in exported.items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=f"{schedule} export: {name}")
    for rank in ranks:
        assert "OwnLoss.compute_loss" in rank["refused"] and "loss_function" in rank["refused"]
        assert rank["predict"].startswith("evaluate and predict do not run under the pipeline axis yet")

    # checkpoint-2 of the 1f1b run: its two stages are one model, which one process resumes
    checkpoint = tmp_path / "1f1b" / "checkpoint-2"
    model = llama(seed=1)
    trainer = Trainer(
        model, config(str(tmp_path / "resumed"), {"name": "model_parallel", "device": "cpu"}), train_dataset=data()
    )
    trainer.fit(resume_from_checkpoint=str(checkpoint))
    resumed = trainer.strategy.model_state_for_export(trainer.model)
    trainer.teardown()
    for name, value in want.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-5, msg=f"resumed: {name} differs")

    # the last checkpoint as a from_pretrained folder: the whole model, the weights the run ended with
    convert_checkpoint(str(tmp_path / "1f1b" / "checkpoint-4"), str(tmp_path / "hf"), None)
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-5, msg=f"converted: {name} differs")


if __name__ == "__main__":
    worker(sys.argv[1])
