"""`kiln plot RUN_DIR [RUN_DIR ...] [--metrics loss,eval_loss] [-o curves.png]`: training curves from
each run's local history, one subplot per metric, runs overlaid with labels, written as a PNG.

A run's history is the first of `metrics.jsonl`, `metrics.csv`, `trainer_state.json` (its
`log_history`), or the newest checkpoint's `trainer_state.json`; a path to one of those files works
too. matplotlib is imported here only, with its non-interactive Agg canvas (no display needed)."""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import re
import sys
from collections.abc import Sequence

from kiln.loggers.base import MissingPackageError, require

History = list[tuple[int, dict[str, float]]]  # (step, metrics) per log call

#: shown when --metrics is not given, in this order, if the runs have them
DEFAULT_METRICS = ("loss", "eval_loss", "learning_rate")
#: bookkeeping keys never worth a subplot of their own
_SKIP = re.compile(r"^(step|epoch|total_flos|num_input_tokens_seen)$|_runtime$|_per_second$|_mem_|^before_init_")


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _rows(rows: Sequence[dict[str, object]]) -> History:
    history: History = []
    for row in rows:
        step = _number(row.get("step"))
        if step is None:
            continue
        values = {k: v for k, v in ((k, _number(v)) for k, v in row.items() if k != "step") if v is not None}
        history.append((int(step), values))
    return history


def history_file(run: str) -> str:
    """The file `read_history` uses for a run folder (or the file itself)."""
    if os.path.isfile(run):
        return run
    for name in ("runs/metrics.jsonl", "runs/metrics.csv", "metrics.jsonl", "metrics.csv", "trainer_state.json"):
        if os.path.isfile(os.path.join(run, name)):  # run files live in output_dir/runs (older runs: output_dir)
            return os.path.join(run, name)
    states = glob.glob(os.path.join(run, "checkpoint-*", "trainer_state.json"))
    numbered = [(int(m.group(1)), p) for p in states if (m := re.search(r"checkpoint-(\d+)", p))]
    if numbered:
        return max(numbered)[1]
    raise FileNotFoundError(
        f"{run} holds no history: expected metrics.jsonl, metrics.csv or trainer_state.json "
        "(log.history writes the first two: when set, or with a tracker in report_to)."
    )


def read_history(run: str) -> History:
    """(step, {metric: value}) for each log call of a run, in the order they were logged."""
    path = history_file(run)
    with open(path, encoding="utf-8", newline="") as fh:
        if path.endswith(".jsonl"):
            return _rows([json.loads(line) for line in fh if line.strip()])
        if path.endswith(".csv"):
            return _rows(list(csv.DictReader(fh)))
        return _rows(json.load(fh).get("log_history", []))


def _labels(runs: Sequence[str]) -> list[str]:
    """The runs' folder names, or their paths where two names collide."""
    names = [os.path.basename(os.path.normpath(r)) or r for r in runs]
    return [n if names.count(n) == 1 else os.path.normpath(r) for n, r in zip(names, runs)]


def _pick_metrics(histories: Sequence[History], metrics: Sequence[str] | None) -> list[str]:
    present: dict[str, None] = {}
    for history in histories:
        for _, values in history:
            present.update(dict.fromkeys(values))
    if metrics:
        chosen = [m for m in metrics if m in present]
        if not chosen:
            have = ", ".join(present) or "nothing"
            raise ValueError(f"None of {', '.join(metrics)} was logged; the runs have: {have}.")
        return chosen
    defaults = [m for m in DEFAULT_METRICS if m in present]
    return defaults or [m for m in present if not _SKIP.search(m)][:12]


def plot_runs(run_dirs: list[str], metrics: list[str] | None = None, out: str = "curves.png") -> str:
    """Render `metrics` (default: loss, eval_loss, learning_rate where logged) of every run to `out`;
    returns the path written."""
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory.")
    require("matplotlib", "plot", "kiln plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    histories = [read_history(run) for run in run_dirs]
    names = _pick_metrics(histories, metrics)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(5 * cols, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, metric in zip(axes, names):
        for i, (label, history) in enumerate(zip(_labels(run_dirs), histories)):
            points = [(step, values[metric]) for step, values in history if metric in values]
            if points:  # one colour per run across every subplot
                xs, ys = zip(*points)
                ax.plot(
                    xs, ys, label=label, color=f"C{i % 10}", marker="o" if len(points) <= 20 else None, markersize=3
                )
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if metric == "learning_rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.legend(fontsize="small")
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`kiln plot`: prints the PNG's path; a missing history or metric is one line on stderr, exit 2."""
    parser = argparse.ArgumentParser(prog="kiln plot", description="Plot training curves of one or more runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output_dir of a run (or its metrics file)")
    parser.add_argument("--metrics", default=None, help="comma-separated, e.g. loss,eval_loss,learning_rate")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG to write (default curves.png)")
    args = parser.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    try:
        path = plot_runs(args.runs, metrics, args.output)
    except (FileNotFoundError, ValueError, MissingPackageError) as err:
        print(f"kiln plot: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
