"""Where the per-step gap between kiln and the hand-written loop lands, phase by phase.

    python bench/step_phases.py --rounds 4 --steps 3000      # the table in docs/benchmarks.md

Both loops of bench/compare.py (and the loop with HF's two param groups) run in this process, alternating, on
one CPU thread, with a timer around each of torch's calls that both make: the DataLoader's `__next__`
(fetch and collate), the model's forward, `Tensor.backward`, `clip_grad_norm_`, `AdamW.step`, the
scheduler's `step` and `zero_grad`. What no timer covers ("rest") is each loop's own Python between
those calls: for kiln its loop, callbacks and strategy layers. Printed: medians over rounds of µs per
call (per step), each timer costing both loops alike (about 1 µs per call). A phase that is slower in
kiln although the same torch code runs in it (forward, backward) shows the cost of kiln's larger
footprint between the calls (colder caches), which no timer can attribute."""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.utils.data.dataloader as dataloader  # noqa: E402

from bench import models  # noqa: E402
from bench.compare import HAND_HF_GROUPS, MODELS, RUNNERS, Clock  # noqa: E402

TOTALS: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()
PHASES = ("next", "forward", "backward", "clip", "optimizer", "scheduler", "zero_grad")


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # kiln reads the forward's signature
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter_ns() - start
            CALLS[name] += 1

    return wrapper


def instrument() -> None:
    dataloader._BaseDataLoaderIter.__next__ = timed("next", dataloader._BaseDataLoaderIter.__next__)
    for net in (models.MLP, models.SmallTransformer):
        net.forward = timed("forward", net.forward)
    torch.Tensor.backward = timed("backward", torch.Tensor.backward)
    torch.nn.utils.clip_grad_norm_ = timed("clip", torch.nn.utils.clip_grad_norm_)
    torch.optim.AdamW.step = timed("optimizer", torch.optim.AdamW.step)
    torch.optim.lr_scheduler.LRScheduler.step = timed("scheduler", torch.optim.lr_scheduler.LRScheduler.step)
    torch.optim.Optimizer.zero_grad = timed("zero_grad", torch.optim.Optimizer.zero_grad)


def one_run(framework: str, model: str, steps: int) -> dict[str, float]:
    """µs per call of each phase over a whole run (its few warm-up steps are a negligible share), and per step."""
    TOTALS.clear()
    CALLS.clear()
    clock = Clock(time.time(), steps)
    with tempfile.TemporaryDirectory() as out:
        RUNNERS[framework](model, MODELS[model].batch, steps, clock, out)
    per_call = {name: TOTALS[name] / CALLS[name] / 1e3 for name in PHASES if CALLS[name]}
    step = clock.result()["per_step"] * 1e6
    return {**per_call, "rest": step - sum(per_call.values()), "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=[m for m, w in MODELS.items() if not w.as_loader])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    instrument()
    frameworks = ("hand-written", HAND_HF_GROUPS, "kiln")
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in frameworks}
    for r in range(args.rounds):
        for framework in frameworks if r % 2 == 0 else frameworks[::-1]:
            runs[framework].append(one_run(framework, args.model, args.steps))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    columns = [*PHASES, "rest", "step"]
    print(f"{MODELS[args.model].label}, {args.steps} steps per run, {args.rounds} rounds; µs per step, medians\n")
    print("| | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    median = {f: {c: statistics.median(run[c] for run in runs[f]) for c in columns} for f in frameworks}
    for framework in frameworks:
        print(f"| {framework} | " + " | ".join(f"{median[framework][c]:.1f}" for c in columns) + " |")
    for base in ("hand-written", HAND_HF_GROUPS):
        print(f"| kiln − {base} | " + " | ".join(f"{median['kiln'][c] - median[base][c]:+.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
