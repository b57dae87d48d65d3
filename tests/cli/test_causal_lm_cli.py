"""`kiln fit` on a Transformers causal LM named by a task (issue 30, item 12a): evaluation during
training with compute_metrics runs through the model's KV cache output, which kiln leaves out of the
predictions as HF does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln import cli

pytest.importorskip("transformers")

TASK = """
import numpy as np
import torch
import transformers


def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, use_cache=True)
    return transformers.GPT2LMHeadModel(config)


def token_accuracy(pred):
    logits, labels = pred
    return {"token_accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}


def data():
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 64, (10, 16), generator=g)]
    return {"train_dataset": rows, "eval_dataset": rows, "compute_metrics": token_accuracy}
"""


def test_fit_evaluates_a_causal_lm_with_compute_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lmtask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        "output_dir: run\ntask: {model: 'lmtask:model', data: 'lmtask:data'}\nmax_steps: 2\n"
        "per_device_train_batch_size: 4\nper_device_eval_batch_size: 4\n"
        "eval: {strategy: steps, steps: 1}\nlog: {disable_tqdm: true}\nreport_to: none\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["fit", "cfg.yaml"]) == 0
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    evals = [row["step"] for row in state["log_history"] if "eval_token_accuracy" in row]
    assert evals == [1, 2, 2]  # during training, then fit's final evaluation
    assert "eval_token_accuracy" in json.loads((tmp_path / "run" / "eval_results.json").read_text())
