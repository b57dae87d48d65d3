"""HF's metric helpers: log_metrics, save_metrics (<split>_results.json, all_results.json), metrics_format,
save_state."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from kiln import Trainer
from tests.evaluation.common import accuracy, config, digits, make_model


@pytest.fixture()
def trainer(tmp_path: Any) -> Trainer:
    train, evals = digits(n_train=32, n_eval=32)
    return Trainer(
        make_model("module"),
        config(tmp_path, max_steps=2, per_device_train_batch_size=16),
        train_dataset=train,
        eval_dataset=evals,
        compute_metrics=accuracy,
    )


def test_save_metrics_writes_split_and_merged_files(trainer: Trainer, tmp_path: Any) -> None:
    out = tmp_path / "out"
    train_metrics = trainer.fit().metrics
    eval_metrics = trainer.evaluate()
    trainer.save_metrics("train", train_metrics)
    trainer.save_metrics("eval", eval_metrics)
    assert json.loads((out / "train_results.json").read_text()) == pytest.approx(train_metrics)
    assert json.loads((out / "eval_results.json").read_text()) == pytest.approx(eval_metrics)  # raw numbers
    merged = json.loads((out / "all_results.json").read_text())
    assert merged == pytest.approx({**train_metrics, **eval_metrics})

    trainer.save_metrics("eval", {"eval_loss": 1.5})  # a later call updates the merged file
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] == 1.5
    trainer.save_metrics("test", {"test_x": np.float32(0.25), "test_n": np.int64(3)}, combined=False)
    assert json.loads((out / "test_results.json").read_text()) == {"test_n": 3, "test_x": 0.25}
    assert "test_x" not in json.loads((out / "all_results.json").read_text())


def test_log_metrics_prints_an_aligned_block(trainer: Trainer, capsys: Any) -> None:
    trainer.log_metrics("eval", {"eval_loss": 0.123456789, "eval_runtime": 62.5, "epoch": 1.0, "total_flos": 3 << 30})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "***** eval metrics *****"
    assert [line.split("=")[0].strip() for line in lines[1:]] == ["epoch", "eval_loss", "eval_runtime", "total_flos"]
    assert len({line.index("=") for line in lines[1:]}) == 1  # keys padded to one column
    assert lines[2].endswith("0.1235") and lines[3].endswith("0:01:02.50") and lines[4].endswith("3GF")


def test_metrics_format(trainer: Trainer) -> None:
    formatted = trainer.metrics_format(
        {
            "eval_loss": 0.123456789,
            "eval_runtime": 3.25,
            "train_mem_cpu_alloc_delta": 5 << 20,
            "total_flos": 2 << 30,
            "eval_samples": 7,
        }
    )
    assert formatted == {
        "eval_loss": 0.1235,
        "eval_runtime": "0:00:03.25",
        "train_mem_cpu_alloc_delta": "5MB",
        "total_flos": "2GF",
        "eval_samples": 7,
    }


def test_save_state(trainer: Trainer, tmp_path: Any) -> None:
    trainer.fit()
    trainer.evaluate()
    trainer.save_state()
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert any("eval_loss" in entry for entry in state["log_history"])
    assert state["log_history"] == json.loads(json.dumps(trainer.state.log_history))


def test_memory_metrics(tmp_path: Any) -> None:
    pytest.importorskip("psutil")
    _, evals = digits(n_eval=32)
    trainer = Trainer(make_model("module"), config(tmp_path, skip_memory_metrics=False), eval_dataset=evals)
    metrics = trainer.evaluate()
    assert {"eval_mem_cpu_alloc_delta", "eval_mem_cpu_peaked_delta"} <= set(metrics)
    assert {"test_mem_cpu_alloc_delta", "test_mem_cpu_peaked_delta"} <= set(trainer.predict(evals).metrics)
    assert (
        "eval_mem_cpu_alloc_delta" not in Trainer(make_model("module"), config(tmp_path), eval_dataset=evals).evaluate()
    )
