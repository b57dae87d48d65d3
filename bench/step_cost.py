"""Where kiln's per-step overhead goes: kiln against the hand-written loop of bench/compare.py (and that loop
with HF's two param groups, as kiln's optimizer has them), on the same model, data and settings (AdamW
without decay, linear schedule, clipping, a log event every 10 steps with progress and csv + jsonl history on).

    python bench/step_cost.py --rounds 7              # the figures in docs/benchmarks.md
    python bench/step_cost.py --profile               # plus kiln's own functions, by CPU time per step
    python bench/step_cost.py --counts                # only the counts: aten ops and Python calls per step

The counts do not depend on the machine's load (the Python count moves by under one call a step between
runs), so they compare two commits closely: a change to the
step must leave kiln's aten ops per step unchanged and its Python calls per step within a few percent.

Three figures per step, over the steps after a warm-up:
- aten operators dispatched (counted with a TorchDispatchMode, in a separate run, since counting slows
  the step): the tensor work kiln adds beyond the hand-written loop's;
- CPU time of the training thread (`time.thread_time`), the figure the step ratio follows on a busy
  machine: Python bookkeeping shows here even where the wall clock hides it in noise;
- wall time;
- Python function calls (cProfile's count of calls to functions written in Python, builtins left out,
  in a separate run): the interpreter work of the framework's own layers.
Both runs happen in this process, alternating in a new random order each round, one CPU thread;
printed are medians with their spread (min-max over rounds). `--profile` adds one cProfile run of kiln
and lists the kiln functions with the most CPU time of their own per step."""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.compare import HAND_HF_GROUPS, MODELS, WARMUP, Clock  # noqa: E402
from bench.compare import RUNNERS as ALL_RUNNERS

#: kiln against the loop, and against the loop with HF's (and kiln's) two param groups: the optimizer work kiln's is
RUNNERS: dict[str, Callable[..., None]] = {name: ALL_RUNNERS[name] for name in ("hand-written", HAND_HF_GROUPS, "kiln")}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Meter(Clock):
    """compare.py's Clock, plus the training thread's CPU time, and optionally an operator count or a
    profile, over the timed steps only."""

    def __init__(self, steps: int, counter: OpCounter | None = None, profiler: cProfile.Profile | None = None) -> None:
        super().__init__(time.time(), steps)
        self.counter, self.profiler = counter, profiler
        self.cpu_start = self.cpu_end = 0.0

    def step_begin(self, done: int) -> None:
        if done == WARMUP:
            if self.counter is not None:
                self.counter.__enter__()
            if self.profiler is not None:
                self.profiler.enable()
            self.cpu_start = time.thread_time()
        super().step_begin(done)

    def step_end(self, done: int) -> None:
        super().step_end(done)
        if done == self.steps:
            self.cpu_end = time.thread_time()
            if self.profiler is not None:
                self.profiler.disable()
            if self.counter is not None:
                self.counter.__exit__(None, None, None)

    @property
    def timed(self) -> int:
        return self.steps - WARMUP


def run(framework: str, model: str, steps: int, **meter: Any) -> Meter:
    clock = Meter(steps, **meter)
    with tempfile.TemporaryDirectory() as out:
        RUNNERS[framework](model, MODELS[model][1], steps, clock, out)
    return clock


def python_calls(framework: str, model: str, steps: int) -> float:
    """Calls to Python functions per timed step (cProfile; calls of builtins and C functions left out)."""
    profiler = cProfile.Profile()
    clock = run(framework, model, steps, profiler=profiler)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    calls = sum(n for (path, _, _), (_, n, _, _, _) in stats.items() if path != "~")
    return calls / clock.timed


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also list kiln's functions by own CPU time per step")
    parser.add_argument(
        "--counts", action="store_true", help="only count aten ops and Python calls per step (no timing)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    ops = {}
    counted_steps = max(WARMUP + 20, args.steps // 10)
    for framework in RUNNERS:
        counter = OpCounter()
        clock = run(framework, args.model, counted_steps, counter=counter)
        ops[framework] = counter.ops, clock.timed
    calls = {framework: python_calls(framework, args.model, counted_steps) for framework in RUNNERS}
    if args.counts:
        print(f"{MODELS[args.model][0]}, counted over {counted_steps - WARMUP} steps after {WARMUP} warm-up steps\n")
        print("| | aten ops / step | Python calls / step |")
        print("|---|---|---|")
        for framework in RUNNERS:
            counted, timed = ops[framework]
            print(f"| {framework} | {sum(counted.values()) / timed:.2f} | {calls[framework]:.1f} |")
        return
    cpu: dict[str, list[float]] = {f: [] for f in RUNNERS}
    wall: dict[str, list[float]] = {f: [] for f in RUNNERS}
    rng = random.Random(0)
    for r in range(args.rounds):
        order = list(RUNNERS)
        rng.shuffle(order)
        for framework in order:
            clock = run(framework, args.model, args.steps)
            cpu[framework].append((clock.cpu_end - clock.cpu_start) / clock.timed * 1e6)
            wall[framework].append((clock.end - clock.start) / clock.timed * 1e6)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    print(
        f"{MODELS[args.model][0]}, {args.steps} steps per run, {args.rounds} rounds; medians (min–max); one CPU thread\n"
    )
    print("| | aten ops / step | Python calls / step | CPU µs / step (training thread) | wall µs / step |")
    print("|---|---|---|---|---|")
    for framework in RUNNERS:
        counted, timed = ops[framework]
        print(
            f"| {framework} | {sum(counted.values()) / timed:.2f} | {calls[framework]:.1f} | "
            f"{spread(cpu[framework], '.1f')} | {spread(wall[framework], '.1f')} |"
        )
    for base in ("hand-written", HAND_HF_GROUPS):
        extra_cpu = [k - h for k, h in zip(cpu["kiln"], cpu[base])]
        extra_wall = [k / h for k, h in zip(wall["kiln"], wall[base])]
        (k_ops, k_n), (h_ops, h_n) = ops["kiln"], ops[base]
        print(
            f"\nkiln over {base}: {sum(k_ops.values()) / k_n - sum(h_ops.values()) / h_n:+.2f} aten ops / step, "
            f"{spread(extra_cpu, '+.1f')} CPU µs / step, wall ratio {spread(extra_wall, '.3f')} (paired by round)"
        )
        extra = {name: k_ops[name] / k_n - h_ops.get(name, 0) / h_n for name in k_ops}
        shown = sorted(((v, n) for n, v in extra.items() if abs(v) >= 0.005), reverse=True)
        if shown:
            print("extra operators per step: " + ", ".join(f"{n} {v:+.2f}" for v, n in shown))

    if args.profile:
        profiler = cProfile.Profile()
        clock = run("kiln", args.model, args.steps, profiler=profiler)
        stats = pstats.Stats(profiler)
        rows = [
            (tt / clock.timed * 1e6, calls / clock.timed, f"{os.path.relpath(path)}:{line} {name}")
            for (path, line, name), (_, calls, tt, _, _) in stats.stats.items()  # type: ignore[attr-defined]
            if f"{os.sep}kiln{os.sep}" in path
        ]
        print("\nkiln functions by own CPU time (profiled, so inflated), µs / step and calls / step:")
        for us, calls, where in sorted(rows, reverse=True)[:25]:
            print(f"  {us:7.1f} µs  {calls:5.2f}  {where}")


if __name__ == "__main__":
    main()
