"""`kiln plot`: curves of several runs from their local histories into one PNG."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("matplotlib", reason="kiln plot needs matplotlib")

from kiln.plot import main, plot_runs, read_history  # noqa: E402


def write_runs(tmp_path):
    """Run a (runs/metrics.jsonl, where kiln writes it), run b (metrics.csv at the top, as older kiln
    versions wrote it), run c (only a checkpoint's trainer_state.json)."""
    a, b, c = (tmp_path / name for name in ("run-a", "run-b", "run-c"))
    for d in (a / "runs", b, c / "checkpoint-10", c / "checkpoint-30"):
        d.mkdir(parents=True)
    with open(a / "runs" / "metrics.jsonl", "w") as fh:
        for step in range(1, 41):
            fh.write(json.dumps({"step": step, "loss": 2.0 / step, "learning_rate": 1e-3 * (1 - step / 40)}) + "\n")
            if step % 10 == 0:
                fh.write(json.dumps({"step": step, "eval_loss": 2.5 / step, "epoch": step / 40}) + "\n")
    with open(b / "metrics.csv", "w") as fh:
        fh.write("step,loss,learning_rate,eval_loss\n")
        for step in range(1, 41):
            fh.write(f"{step},{1.0 / step**0.5},{5e-4},{'' if step % 10 else 1.5 / step}\n")
    history = [{"loss": 3.0 / s, "step": s} for s in range(1, 31)]
    (c / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"log_history": history[:10]}))
    (c / "checkpoint-30" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return [str(a), str(b), str(c)]


def test_histories_from_each_kind_of_file(tmp_path):
    a, b, c = write_runs(tmp_path)
    assert read_history(a)[:2] == [
        (1, {"loss": 2.0, "learning_rate": 1e-3 * (1 - 1 / 40)}),
        (2, {"loss": 1.0, "learning_rate": 1e-3 * (1 - 2 / 40)}),
    ]
    assert read_history(b)[9] == (10, {"loss": 1.0 / 10**0.5, "learning_rate": 5e-4, "eval_loss": 0.15})
    assert len(read_history(c)) == 30  # the newest checkpoint's log_history


def test_two_runs_overlaid_into_a_real_png(tmp_path):
    from PIL import Image

    runs = write_runs(tmp_path)[:2]
    out = plot_runs(runs, None, str(tmp_path / "curves.png"))
    assert out == str(tmp_path / "curves.png") and os.path.getsize(out) > 20_000
    image = Image.open(out).convert("RGB")
    assert image.size == (1500, 360)  # three subplots side by side: loss, eval_loss, learning_rate
    colors = image.getcolors(maxcolors=1_000_000)
    blue, orange = (31, 119, 180), (255, 127, 14)  # matplotlib's first two line colours: one per run
    present = {c for _, c in colors}
    assert blue in present and orange in present and len(colors) > 50


def test_cli_metrics_and_output(tmp_path, capsys):
    runs = write_runs(tmp_path)
    out = tmp_path / "sub" / "c.png"
    assert main([*runs, "--metrics", "loss,eval_loss", "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.stat().st_size > 10_000
    assert main([str(tmp_path / "missing")]) == 2
    assert "holds no history" in capsys.readouterr().err
    assert main([runs[0], "--metrics", "bleu"]) == 2
    assert "None of bleu was logged" in capsys.readouterr().err


def test_without_matplotlib_the_message_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    runs = write_runs(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([runs[0], "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install kiln[plot]" in capsys.readouterr().err
