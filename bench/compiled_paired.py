"""Compiled training, paired in one process: the hand-written torch.compile loop, that loop with HF's two param
groups, and kiln, taking turns in a new random order each round, in this one process (bench/compiled.py's runners
and recipe). On a launch-bound GPU workload the step time of the same loop moves by ±10 % from one process to the
next (a fresh CUDA context, allocator and CPU placement each time; docs/benchmarks.md), which hides a few per cent;
within one process the frameworks share all of that, so the per-round ratio kiln / loop is what differs.

    python bench/compiled_paired.py --device cuda --models mlp lm16 --rounds 6 --steps 600
    python bench/compiled_paired.py --models mlp --rounds 3 --steps 300        # CPU

Every run compiles its model anew (dynamo's caches are reset between runs; inductor's on-disk cache is shared, so
after the first round a compile is a cache hit). Printed per workload and framework: ms a step after the warm-up
(median, min–max over rounds), and the median (min–max) of the per-round ratios to the loop's run of that round."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.compare import HAND_HF_GROUPS, LABELS  # noqa: E402
from bench.compiled import RUNNERS, WORKLOADS, Setup, SyncedClock, make  # noqa: E402

FRAMEWORKS = ("hand-written", HAND_HF_GROUPS, "kiln")


def one_run(framework: str, model: str, steps: int, s: Setup) -> float:
    """Seconds a step after the warm-up, for one fresh model compiled anew."""
    torch._dynamo.reset()
    clock = SyncedClock(time.time(), steps, torch.cuda.synchronize if s.cuda else lambda: None)
    net, data = make(model)
    with tempfile.TemporaryDirectory() as out:
        RUNNERS[framework](model, net, data, steps, clock, out, s)
    return clock.result()["per_step"]


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "lm16"], choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--budget", type=float, help="seconds: start no round that would likely end past this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    s = Setup(args.device, "inductor", None)
    began, rng = time.perf_counter(), random.Random(0)
    times: dict[tuple[str, str], list[float]] = {(m, f): [] for m in args.models for f in FRAMEWORKS}
    ratios: dict[tuple[str, str], list[float]] = {(m, f): [] for m in args.models for f in FRAMEWORKS}
    for r in range(args.rounds):
        spent = time.perf_counter() - began
        if args.budget and r and spent / r * (r + 1) > args.budget:
            print(f"stopped by --budget {args.budget:g} s after {r} round(s)", file=sys.stderr)
            break
        for model in args.models:
            order = list(FRAMEWORKS)
            rng.shuffle(order)
            this = {f: one_run(f, model, args.steps, s) for f in order}
            for f, t in this.items():
                times[model, f].append(t * 1e3)
                ratios[model, f].append(t / this["hand-written"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if s.cuda else "cpu"
    print(f"\n{args.steps} steps a run on {device}, frameworks in turn in one process; medians (min–max over rounds)\n")
    print("| workload | framework | ms / step | ratio to the loop (paired by round) |\n|---|---|---|---|")
    for (model, f), values in times.items():
        if values:
            print(
                f"| {WORKLOADS[model].label} | {LABELS[f]} | {spread(values, '.3f')} | {spread(ratios[model, f], '.3f')} |"
            )


if __name__ == "__main__":
    main()
