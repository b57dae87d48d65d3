"""What the training loader kiln builds costs per batch, against the hand-written loop's DataLoader over the
same data (bench/compare.py's workloads; issue 33's transformer data by default).

    python bench/loader_cost.py                          # counts, then interleaved timing of the loaders alone
    python bench/loader_cost.py --model augment-w0       # the per-sample-transform data
    python bench/loader_cost.py --fit                    # plus whole training steps: kiln handed the dataset,
                                                         # kiln handed the DataLoader, the hand-written loop

Counts do not depend on the machine's load, so they are the figures to compare on a busy machine:
- Python function calls per batch (cProfile), and the functions kiln's loader calls more often;
- aten operators per batch (torch.profiler; nested operators included).
Timing: the loaders alternate `--rounds` times in a new random order each round, each reading `--epochs`
epochs in this process (one CPU thread); printed are the training thread's CPU time and the wall time per
batch, medians (min-max over rounds). With workers, the CPU figure is the main process's only."""

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
from collections.abc import Callable, Iterable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.compare import MODELS, build, hand_loader, kiln_config  # noqa: E402


def kiln_loader(model: str, out: str) -> Any:
    """The loader kiln's Trainer builds for workload `model`, as fit() gets it."""
    from kiln import Trainer

    net, data = build(model)
    batch = MODELS[model].batch
    if MODELS[model].as_loader:
        data = hand_loader(model, data, batch)
    return Trainer(net, kiln_config(model, batch, 100, out), train_dataset=data).get_train_dataloader()


def read(loader: Iterable[Any], epochs: int) -> int:
    """Every batch of `epochs` epochs, as the fit loop reads them (kiln's set_epoch first); the batch count."""
    from kiln.engine.data.loaders import set_epoch

    n = 0
    for epoch in range(epochs):
        set_epoch(loader, epoch, 0)
        for _ in loader:
            n += 1
    return n


def calls(loader: Iterable[Any], epochs: int) -> tuple[float, dict[str, float]]:
    """Python calls per batch, in all and by function."""
    profiler = cProfile.Profile()
    profiler.enable()
    n = read(loader, epochs)
    profiler.disable()
    stats = pstats.Stats(profiler)
    by_function = {
        f"{os.path.basename(path)}:{line} {name}": c / n for (path, line, name), (_, c, _, _, _) in stats.stats.items()
    }  # type: ignore[attr-defined]
    return stats.total_calls / n, by_function  # type: ignore[attr-defined]


def aten_ops(loader: Iterable[Any], epochs: int) -> tuple[float, dict[str, float]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        n = read(loader, epochs)
    counted = {e.key: e.count / n for e in prof.key_averages() if e.key.startswith("aten::")}
    return sum(counted.values()), counted


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def differences(mine: dict[str, float], theirs: dict[str, float], limit: int = 15) -> list[str]:
    extra = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in set(mine) | set(theirs)}
    shown = sorted(((v, k) for k, v in extra.items() if abs(v) >= 0.01), key=lambda t: -abs(t[0]))[:limit]
    return [f"  {v:+8.2f}  {k}" for v, k in shown]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lm16", choices=list(MODELS))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--fit", action="store_true", help="also count whole steps (kiln with the dataset, with the loader)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = tempfile.mkdtemp()
    makers: dict[str, Callable[[], Any]] = {
        "kiln-built": lambda: kiln_loader(args.model, out),
        "hand-written": lambda: hand_loader(args.model, build(args.model)[1], MODELS[args.model].batch),
    }
    print(f"{MODELS[args.model].label}, batch {MODELS[args.model].batch}, {args.epochs} epochs per reading\n")
    counted = {name: (calls(make(), args.epochs), aten_ops(make(), args.epochs)) for name, make in makers.items()}
    print("| loader | Python calls / batch | aten ops / batch |\n|---|---|---|")
    for name, ((n_calls, _), (n_ops, _)) in counted.items():
        print(f"| {name} | {n_calls:.1f} | {n_ops:.1f} |")
    print("\nPython calls / batch, kiln-built minus hand-written, by function:")
    print("\n".join(differences(counted["kiln-built"][0][1], counted["hand-written"][0][1])) or "  (none)")
    print("aten ops / batch, kiln-built minus hand-written:")
    print("\n".join(differences(counted["kiln-built"][1][1], counted["hand-written"][1][1])) or "  (none)")

    cpu: dict[str, list[float]] = collections.defaultdict(list)
    wall: dict[str, list[float]] = collections.defaultdict(list)
    rng = random.Random(0)
    loaders = {name: make() for name, make in makers.items()}
    for _ in range(args.rounds):
        order = list(loaders)
        rng.shuffle(order)
        for name in order:
            c, w = time.thread_time(), time.perf_counter()
            n = read(loaders[name], args.epochs)
            cpu[name].append((time.thread_time() - c) / n * 1e6)
            wall[name].append((time.perf_counter() - w) / n * 1e6)
    print(f"\n{args.rounds} interleaved rounds; medians (min–max)\n")
    print("| loader | CPU µs / batch (main thread) | wall µs / batch |\n|---|---|---|")
    for name in loaders:
        print(f"| {name} | {spread(cpu[name], '.1f')} | {spread(wall[name], '.1f')} |")
    ratios = [k / h for k, h in zip(wall["kiln-built"], wall["hand-written"])]
    print(f"\nwall ratio kiln-built / hand-written, paired by round: {spread(ratios, '.3f')}")
    if args.fit:
        fit_counts(args.model)


def fit_counts(model: str) -> None:
    """Whole training steps, counted: the hand-written loop, kiln handed the dataset, kiln handed the loader."""
    from bench.step_cost import Meter, run

    variants = [("hand-written", model), ("kiln", model)]
    loader_twin = next((m for m, w in MODELS.items() if w.as_loader and w.net == MODELS[model].net), None)
    if loader_twin is not None and not MODELS[model].as_loader:
        variants.append(("kiln", loader_twin))
    print("\n| run | Python calls / step | aten ops / step |\n|---|---|---|")
    for framework, workload in variants:
        profiler = cProfile.Profile()
        clock: Meter = run(framework, workload, 40, profiler=profiler)
        n_calls = pstats.Stats(profiler).total_calls / clock.timed  # type: ignore[attr-defined]
        counter = _StepOps()
        clock = run(framework, workload, 40, counter=counter)
        print(f"| {framework}, {MODELS[workload].label} | {n_calls:.1f} | {counter.total / clock.timed:.1f} |")


class _StepOps:
    """torch.profiler over the timed steps only (step_cost.Meter enters and leaves it)."""

    def __init__(self) -> None:
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.total = 0.0

    def __enter__(self) -> None:
        self.prof.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)
        self.total = sum(e.count for e in self.prof.key_averages() if e.key.startswith("aten::"))


if __name__ == "__main__":
    main()
