"""What a `task.data` function may return (issue 52 item 17): every key docs/training-module.md lists is
one the CLI reads, and each reaches what it is for in a real `kiln fit` / `kiln predict`; any other key
is refused with one sentence before the model is built."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kiln import cli
from tests.docs.blocks import REPO

TASK = """
import os

import torch
from kiln import Callback, TrainingModule

SEEN = set()


class Reg(TrainingModule):
    def __init__(self, width=1, hidden=4):
        super().__init__()
        SEEN.add(f"width={width}")
        self.net = torch.nn.Linear(4, hidden)

    def training_step(self, batch):
        return self.net(batch["x"]).pow(2).mean()

    def validation_step(self, batch):
        out = self.net(batch["x"])
        return {"loss": out.pow(2).mean(), "logits": out, "labels": batch["y"]}


def collate(items):
    SEEN.add("data_collator")
    return {"x": torch.stack([i["x"] for i in items]), "y": torch.stack([i["y"] for i in items])}


def metrics(pred):
    SEEN.add("compute_metrics")
    return {"shape": float(pred.predictions.shape[-1])}


def keep(logits, labels):
    SEEN.add("preprocess_logits_for_metrics")
    return logits[:, :2]


class Mark(Callback):
    def on_train_begin(self, args, state, control, **kwargs):
        SEEN.add("callbacks")


class Tokenizer:
    def save_pretrained(self, folder):
        with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
            fh.write("{}")


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, generator=g), "y": torch.randn((), generator=g)} for _ in range(n)]


def data(extra=None, bare=None):
    if bare == "list":
        return [rows(8, 0)]
    if bare == "dict":
        return {"test_dataset": rows(8, 0)}
    if bare == "eval":
        return {"eval_dataset": rows(4, 1)}
    out = {"train_dataset": rows(8, 0), "eval_dataset": {"a": rows(4, 1), "b": rows(4, 2)}, "test_dataset": rows(6, 3),
           "data_collator": collate, "compute_metrics": metrics, "preprocess_logits_for_metrics": keep,
           "callbacks": [Mark], "processing_class": Tokenizer(), "model_args": {"width": 3}}
    if extra:
        out[extra] = None
    return out
"""


def _documented() -> list[str]:
    text = (REPO / "docs" / "training-module.md").read_text()
    section = text[text.index("## What a `task.data` function returns") :]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([^`]+)`", line).group(1) for line in table]


def test_the_documented_keys_are_the_ones_kiln_reads():
    assert _documented() == list(cli.DATA_KEYS)


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "keystask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        "output_dir: out\ntask: {model: 'keystask:Reg', data: 'keystask:data'}\nmax_steps: 2\n"
        "per_device_train_batch_size: 4\nsave_steps: 2\nlog: {disable_tqdm: true}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_every_key_reaches_what_it_is_for(task: Path) -> None:
    import keystask

    keystask.SEEN.clear()  # the module outlives a test: another test's runs may have filled it
    assert cli.main(["fit", "cfg.yaml"]) == 0
    assert keystask.SEEN == {
        "width=3",
        "data_collator",
        "compute_metrics",
        "preprocess_logits_for_metrics",
        "callbacks",
    }
    results = json.loads((task / "out" / "eval_results.json").read_text())
    assert results["eval_a_shape"] == results["eval_b_shape"] == 2.0  # both eval sets, the logits cut to 2 columns
    assert (task / "out" / "tokenizer.json").is_file() and (task / "out" / "checkpoint-2" / "tokenizer.json").is_file()
    assert cli.main(["predict", "cfg.yaml"]) == 0
    predicted = json.loads((task / "out" / "predict_results.json").read_text())
    assert predicted["test_shape"] == 2.0 and "test_samples_per_second" in predicted
    import numpy as np

    assert np.load(task / "out" / "predictions.npy").shape == (6, 2)  # test_dataset's 6 rows


def test_another_key_is_refused_before_the_model_is_built(task: Path, capsys: pytest.CaptureFixture) -> None:
    import keystask

    keystask.SEEN.clear()
    assert cli.main(["fit", "cfg.yaml", "task.data_args.extra=collate_fn"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kiln: error: task.data (keystask:data) returned 'collate_fn', which kiln does not read; it reads "
        f"{', '.join(cli.DATA_KEYS)} (docs/training-module.md). Did you mean 'data_collator'?\n"
    ), err
    assert keystask.SEEN == set()


@pytest.mark.parametrize("bare", ["list", "dict"])
def test_a_return_without_a_dataset_to_train_or_evaluate_is_refused(
    task: Path, capsys: pytest.CaptureFixture, bare: str
) -> None:
    assert cli.main(["fit", "cfg.yaml", f"task.data_args.bare={bare}"]) == 2
    assert capsys.readouterr().err == (
        "kiln: error: task.data must return a dict with train_dataset (and optionally eval_dataset, ...).\n"
    )
    assert (
        cli.main(["evaluate", "cfg.yaml", "task.data_args.bare=eval", "--random-weights"]) == 0
    )  # eval_dataset alone will do
