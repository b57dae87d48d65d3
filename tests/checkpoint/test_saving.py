"""What gets saved, when, and in which form: HF's save_strategy / save_steps / save_total_limit /
save_only_model / save_safetensors / save_on_each_node semantics, the contents of a checkpoint, and
`trainer.save_model` exports that load without kiln (and with `from_pretrained`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, read_write

from kiln.engine.callbacks.base import Callback
from kiln.engine.checkpoint.files import is_complete
from kiln.engine.checkpoint.integrity import read_marker
from kiln.strategies.single import SingleDeviceStrategy
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import Scripted, folders, regression_data, train, weights


def hf_files() -> list[str]:
    """HF's training_args.bin: written where the process already uses transformers, never imported for it
    (the rule and both of its sides: tests/checkpoint/test_training_args_file.py). Asked before training,
    so that the answer does not depend on which tests ran before in this process."""
    return ["training_args.bin"] if "transformers" in sys.modules else []


def small_eval():
    return regression_data(8, seed=5)


@pytest.mark.parametrize(
    "cfg, expected",
    [
        ({"max_steps": 12, "save_steps": 5}, {5, 10, 12}),  # every 5 steps, and always at the end (HF)
        ({"max_steps": 12, "save_steps": 0.25}, {3, 6, 9, 12}),  # a ratio of the total steps
        ({"max_steps": -1, "num_train_epochs": 2, "save_strategy": "epoch"}, {10, 20}),  # 10 batches per epoch
        ({"max_steps": 12, "save_strategy": "no"}, set()),
    ],
)
def test_save_strategy_and_steps(tmp_path, cfg, expected):
    out = str(tmp_path / "run")
    train(out, cfg)
    assert folders(out) == {f"checkpoint-{s}" for s in expected}
    assert all(is_complete(os.path.join(out, f)) for f in folders(out))


def test_save_strategy_best_saves_only_improvements(tmp_path):
    out = str(tmp_path / "run")
    scores = [1.0, 3.0, 2.0, 5.0, 4.0, 4.0]  # evaluated at steps 2, 4, ..., 12; greater is better
    trainer = train(
        out,
        {
            "max_steps": 12,
            "save_strategy": "best",
            "eval_strategy": "steps",
            "eval_steps": 2,
            "metric_for_best_model": "score",
        },
        eval_data=small_eval,
        compute_metrics=Scripted(scores),
    )
    assert folders(out) == {"checkpoint-2", "checkpoint-4", "checkpoint-8"}  # no save at the end for `best`
    assert trainer.state.best_metric == 5.0 and trainer.state.best_global_step == 8
    assert trainer.state.best_model_checkpoint == os.path.join(out, "checkpoint-8")


class Counter(Callback):
    """A stateful callback: its state must travel through checkpoints."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, config, state, control, **kw):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_checkpoint_contents(tmp_path):
    out = str(tmp_path / "run")
    hf = hf_files()
    trainer = train(
        out,
        {"max_steps": 6, "save_steps": 3, "eval_strategy": "steps", "eval_steps": 3, "metric_for_best_model": "loss"},
        eval_data=small_eval,
        callbacks=[Counter()],
    )
    ckpt = os.path.join(out, "checkpoint-6")
    assert sorted(os.listdir(ckpt)) == sorted(
        [
            "model.safetensors",
            "optimizer.pt",
            "scheduler.pt",
            "precision.pt",
            "rng_state_0.pth",
            "loop_state_0.pt",
            "trainer_state.json",
            "kiln_loop_position.json",
            "config.yaml",
            "COMPLETE",
            *hf,
        ]
    )
    marker = read_marker(ckpt)
    assert marker["step"] == 6 and marker["world_size"] == 1 and marker["resumable"]
    assert set(marker["files"]) == set(os.listdir(ckpt)) - {"COMPLETE"}
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # no temporary folder left behind

    rng = torch.load(os.path.join(ckpt, "rng_state_0.pth"), weights_only=True)
    assert {"python", "numpy", "torch"} <= set(rng)
    assert ("cuda" in rng) == torch.cuda.is_available()
    state = json.loads(Path(os.path.join(ckpt, "trainer_state.json")).read_text())
    assert state["global_step"] == 6 and state["best_metric"] is not None and state["best_global_step"] in (3, 6)
    assert any("loss" in e for e in state["log_history"]) and any("eval_loss" in e for e in state["log_history"])
    assert state["stateful_callbacks"]["Counter"] == {"steps": 6}
    assert OmegaConf.to_container(OmegaConf.load(os.path.join(ckpt, "config.yaml"))) == OmegaConf.to_container(
        trainer.config
    )

    counter = Counter()
    train(out, {"max_steps": 8, "save_steps": 3}, resume=ckpt, callbacks=[counter])
    assert counter.steps == 8  # 6 restored from the checkpoint + 2 more steps


def test_save_only_model_cannot_be_resumed(tmp_path):
    out = str(tmp_path / "run")
    hf = hf_files()
    train(out, {"max_steps": 4, "save_steps": 2, "save_only_model": True})
    ckpt = os.path.join(out, "checkpoint-4")
    assert sorted(os.listdir(ckpt)) == sorted(
        ["COMPLETE", "config.yaml", "kiln_loop_position.json", "model.safetensors", "trainer_state.json", *hf]
    )
    with pytest.raises(CheckpointError, match="save_only_model"):
        train(out, {"max_steps": 6, "save_steps": 2, "save_only_model": True}, resume=ckpt)


def test_save_safetensors_false_writes_a_bin_that_resumes_exactly(tmp_path):
    cfg = {"max_steps": 8, "save_steps": 4, "save_safetensors": False}
    straight = train(str(tmp_path / "a"), cfg)
    out = str(tmp_path / "b")
    with pytest.raises(RuntimeError):
        train(out, cfg, crash_at=4)
    assert "pytorch_model.bin" in os.listdir(os.path.join(out, "checkpoint-4"))
    assert "model.safetensors" not in os.listdir(os.path.join(out, "checkpoint-4"))
    resumed = train(out, cfg, model_seed=5, resume=True)
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


class LocalZeroOfSecondNode(SingleDeviceStrategy):
    """Pretends to be global rank 1 = local rank 0 of node 1 (a one-process stand-in)."""

    global_rank, local_rank, node_rank = 1, 0, 1


@pytest.mark.parametrize("on_each_node", [True, False])
def test_save_on_each_node(tmp_path, on_each_node):
    out = str(tmp_path / "run")
    trainer = train(
        out,
        {"max_steps": 2, "save_steps": 2, "save_on_each_node": on_each_node, "save_strategy": "no"},
        strategy=LocalZeroOfSecondNode,
    )
    with read_write(trainer.config):  # read-only once loaded
        trainer.config.save.strategy = "steps"
    if not on_each_node:
        os.makedirs(os.path.join(out, ".checkpoint-2.tmp"))  # global rank 0 creates it, behind a barrier
    trainer._save_checkpoint()
    if on_each_node:  # each node's local rank 0 writes the whole checkpoint
        assert folders(out) == {"checkpoint-2"} and is_complete(os.path.join(out, "checkpoint-2"))
        assert "rng_state_1.pth" in os.listdir(os.path.join(out, "checkpoint-2"))
    else:  # only its own RNG file; global rank 0 writes the rest and finalises
        assert folders(out) == {".checkpoint-2.tmp"}
        assert sorted(os.listdir(os.path.join(out, ".checkpoint-2.tmp"))) == ["loop_state_1.pt", "rng_state_1.pth"]


def test_saving_the_same_step_twice_keeps_one_complete_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    trainer = train(out, {"max_steps": 4, "save_steps": 2})
    trainer._save_checkpoint()  # step 4 again
    assert folders(out) == {"checkpoint-2", "checkpoint-4"}
    assert is_complete(os.path.join(out, "checkpoint-4"))


def test_debris_of_a_killed_save_is_cleared_and_never_trusted(tmp_path):
    out = tmp_path / "run"
    train(str(out), {"max_steps": 4, "save_steps": 2})
    os.rename(out / "checkpoint-4", out / ".checkpoint-4.tmp")  # as if killed before the rename
    (out / ".checkpoint-2.deleting").mkdir()  # as if killed while rotating
    trainer = train(str(out), {"max_steps": 6, "save_steps": 2}, resume=True)
    assert json.loads(Path(out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert trainer.state.global_step == 6
    assert folders(str(out)) == {"checkpoint-2", "checkpoint-4", "checkpoint-6"}


def test_debris_another_writer_removed_first_does_not_fail_the_save(tmp_path, monkeypatch):
    """save.on_each_node on a shared output_dir: every node's writer clears the leftovers of a killed run,
    so a leftover may be gone between one writer listing it and deleting it; that writer's save goes on."""
    out = tmp_path / "run"
    (out / ".checkpoint-3.tmp").mkdir(parents=True)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kw):  # type: ignore[no-untyped-def]
        if os.path.basename(path) == ".checkpoint-3.tmp" and os.path.isdir(path):
            real_rmtree(path)  # the other node's writer got there first
        return real_rmtree(path, *args, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    train(str(out), {"max_steps": 2, "save_steps": 2})
    assert folders(str(out)) == {"checkpoint-2"} and is_complete(str(out / "checkpoint-2"))


# -- exports ------------------------------------------------------------------------------------
class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def test_save_model_loads_without_kiln(tmp_path):
    from safetensors.torch import load_model

    ids = torch.randint(0, 10, (16, 5), generator=torch.Generator().manual_seed(0))
    from kiln.engine.trainer import Trainer
    from tests.checkpoint.checkpoint_helpers import config

    torch.manual_seed(0)
    trainer = Trainer(
        Tied(), config(str(tmp_path / "run"), max_steps=3), train_dataset=[{"input_ids": i, "labels": i} for i in ids]
    )
    trainer.fit()
    export = str(tmp_path / "export")
    trainer.save_model(export)
    assert "model.safetensors" in os.listdir(export)
    fresh = Tied()
    load_model(fresh, os.path.join(export, "model.safetensors"))  # plain safetensors, tied weights handled
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.head.weight is fresh.emb.weight


def test_save_model_of_a_transformers_model_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kiln.engine.trainer import Trainer
    from tests.checkpoint.checkpoint_helpers import config

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(hf_config)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    out = str(tmp_path / "run")
    trainer = Trainer(
        model, config(out, max_steps=3, save_steps=3), train_dataset=[{"input_ids": i, "labels": i} for i in ids]
    )
    trainer.fit()
    export = str(tmp_path / "export")
    trainer.save_model(export)
    trained = trainer.model.state_dict()
    for folder in (export, os.path.join(out, "checkpoint-3")):  # the checkpoint loads the same way
        loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
        state = loaded.state_dict()
        assert state.keys() == trained.keys()
        for name in trained:
            assert torch.equal(state[name], trained[name]), (folder, name)
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
