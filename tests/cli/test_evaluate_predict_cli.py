"""`kiln evaluate` / `kiln predict`: they score trained weights (the run's best checkpoint, its export,
its newest checkpoint, or --weights), refuse random weights unless asked, write results beside the
weights and report their step, and never touch the training run's own files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kiln import cli

TASK = """
import torch
import torch.nn.functional as F
from kiln import TrainingModule


class Reg(TrainingModule):
    def __init__(self, hidden=8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch):
        return F.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])

    def validation_step(self, batch):
        pred = self.net(batch["x"]).squeeze(-1)
        return {"loss": F.mse_loss(pred, batch["y"]), "predictions": pred, "labels": batch["y"]}


def data(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    rows = [{"x": x[i], "y": x[i].sum()} for i in range(n)]
    return {"train_dataset": rows, "eval_dataset": rows[:16]}
"""


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Path:
    """A trained run: 6 steps, evaluated and saved every 2 (eval_loss picks the best checkpoint); `kiln fit`
    ends as HF's example scripts do: train and eval metrics printed and written as *_results.json."""
    (tmp_path / "clitask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        "output_dir: run\ntask: {model: 'clitask:Reg', data: 'clitask:data'}\nmax_steps: 6\nlearning_rate: 0.05\n"
        "per_device_train_batch_size: 8\neval: {strategy: steps, steps: 2, metric_for_best_model: loss}\n"
        "save: {strategy: steps, steps: 2}\nlog: {strategy: steps, steps: 2, disable_tqdm: true, history: [csv]}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["fit", "cfg.yaml"]) == 0
    out = capsys.readouterr().out
    assert "***** train metrics *****" in out and "***** eval metrics *****" in out
    assert "train_loss" in json.loads((tmp_path / "run" / "train_results.json").read_text())
    assert "eval_loss" in json.loads((tmp_path / "run" / "eval_results.json").read_text())
    return tmp_path


def _evals(state: dict) -> dict[int, float]:
    return {row["step"]: row["eval_loss"] for row in state["log_history"] if "eval_loss" in row}


def test_evaluate_scores_the_best_checkpoint_and_leaves_the_run_alone(run: Path, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    before = _files(run / "run")
    assert cli.main(["evaluate", "cfg.yaml"]) == 0
    out = capsys.readouterr().out
    state = json.loads((run / "run" / "trainer_state.json").read_text())
    best_step = int(state["best_model_checkpoint"].rsplit("-", 1)[1])
    best = run / "run" / f"checkpoint-{best_step}"
    assert f"kiln: evaluating the best checkpoint {best.relative_to(run)} (step {best_step})" in out
    result = json.loads((best / "evaluate_results.json").read_text())
    assert result["step"] == best_step and result["weights"] == str(best.relative_to(run))
    assert result["epoch"] == json.loads((best / "trainer_state.json").read_text())["epoch"] > 0
    assert result["eval_loss"] == pytest.approx(_evals(state)[best_step], rel=1e-6)  # same weights, same data
    # metrics.csv, eval_results.json and the history files under runs/: only the result file is new
    assert _files(run / "run") == {
        **before,
        best / "evaluate_results.json": (best / "evaluate_results.json").read_bytes(),
    }
    assert any(p.suffix == ".csv" for p in before)  # fit wrote its history file; evaluate none


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_predict_with_given_weights_writes_beside_them(run: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = run / "run" / "checkpoint-2"
    assert cli.main(["predict", "cfg.yaml", "--weights", str(ckpt)]) == 0
    assert f"kiln: predicting with the given weights {ckpt} (step 2)" in capsys.readouterr().out
    assert np.load(ckpt / "predictions.npy").shape == (16,)
    assert json.loads((ckpt / "predict_results.json").read_text())["step"] == 2
    assert not (run / "run" / "predictions.npy").exists()


def test_resume_from_checkpoint_true_means_the_runs_weights(run: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["evaluate", "cfg.yaml", "resume_from_checkpoint=true"]) == 0
    assert "kiln: evaluating the best checkpoint" in capsys.readouterr().out


def test_no_weights_is_refused_unless_random_weights_is_asked_for(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "clitask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text("output_dir: fresh\ntask: {model: 'clitask:Reg', data: 'clitask:data'}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["evaluate", "cfg.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"kiln: error: output_dir 'fresh' (in {tmp_path}) holds no checkpoint or exported model to score"
    )
    assert err.count("\n") == 1
    assert cli.main(["predict", "cfg.yaml", "--random-weights"]) == 0  # its folder made first, for the predictions
    assert np.load(tmp_path / "fresh" / "random-weights" / "predictions.npy").shape[0] > 0
    assert cli.main(["evaluate", "cfg.yaml", "--random-weights"]) == 0
    result = json.loads((tmp_path / "fresh" / "random-weights" / "evaluate_results.json").read_text())
    assert result["step"] == 0 and result["weights"] is None and result["eval_loss"] > 0
    assert cli.main(["evaluate", "cfg.yaml", "--weights", "nowhere"]) == 2
    assert "kiln: error: --weights 'nowhere' is not a folder" in capsys.readouterr().err


def test_version_and_help(capsys: pytest.CaptureFixture) -> None:
    from kiln import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"kiln {__version__}\n"
    assert cli.main(["fit", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("config keys (in the YAML, or key=value on the command line):")
    assert lines[at + 1] == "" and lines[at + 2] == "top level:" and lines[at + 3].startswith("  output_dir = ")
