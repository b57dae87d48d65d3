"""Each example's config.yaml runs end to end through `kiln fit` (shrunk by overrides to a few steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

cli = pytest.importorskip("kiln.cli")

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "char_lm": [
        "task.data_args.max_chars=200000",
        "task.data_args.block_size=32",
        "task.data_args.sample_chars=20",
        "task.model_args.n_layer=1",
        "task.model_args.n_head=2",
        "task.model_args.n_embd=32",
        "data.per_device_eval_batch_size=256",
        "scheduler.warmup_steps=1",
    ],
    "digits": [],
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_example_config_runs_through_kiln_fit(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(REPO_ROOT)  # the configs name their code by import path from the repository root
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    argv = [
        "fit",
        f"examples/{name}/config.yaml",
        f"output_dir={tmp_path}",
        "train.max_steps=5",
        "log.strategy=steps",
        "log.steps=1",
        "log.disable_tqdm=true",
        *TINY[name],
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out

    results = json.loads((tmp_path / "all_results.json").read_text())
    assert results["eval_loss"] > 0 and 0 <= results["eval_accuracy"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5]
    assert (tmp_path / "model.safetensors").exists()
    if name == "char_lm":
        assert "Sample after 5 steps (prompt 'def ')" in out
