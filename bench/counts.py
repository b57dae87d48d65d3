"""Per-step counts that do not depend on the machine's load, taken over a few untimed warm-up steps of a bench
run (bench/compiled.py): aten operators dispatched and, on CUDA, kernel launches (the runtime calls that start
one). Where a launch-bound step differs between two loops, these say whether it is more work or the same work
run slower. torch.profiler records them; a profiler that fails leaves the run without counts, never without
its timings."""

from __future__ import annotations

import statistics
from typing import Any

#: the CUDA runtime and driver calls that launch a kernel (graphs replay through cudaGraphLaunch, counted too)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


class StepCounter:
    """Profiles the steps from `first` to `last` (exclusive, by steps done) and keeps their counts per step."""

    def __init__(self, first: int, last: int, cuda: bool) -> None:
        self.first, self.last, self.cuda = first, last, cuda
        self.profiler: Any = None
        self.counts: dict[str, float] = {}

    def step_begin(self, done: int) -> None:
        try:
            if done == self.first:
                import torch.profiler as tp

                activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
                self.profiler = tp.profile(activities=activities)
                self.profiler.__enter__()
            elif done == self.last and self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                self.counts = self._count(self.profiler.events(), self.last - self.first)
                self.profiler = None
        except Exception as err:  # noqa: BLE001 -- a diagnostic: the timed run goes on without it
            print(f"step counts unavailable: {type(err).__name__}: {err}", flush=True)
            self.profiler = None

    @staticmethod
    def _count(events: Any, steps: int) -> dict[str, float]:
        names = [e.name for e in events]
        return {
            "aten_ops_per_step": sum(n.startswith("aten::") for n in names) / steps,
            "launches_per_step": sum(n in LAUNCHES for n in names) / steps,
        }


def counts_table(
    runs: list[dict[str, Any]],
    models: list[str],
    frameworks: tuple[str, ...],
    labels: dict[str, str],
    workload_label: Any,
) -> str | None:
    """Medians of the counted steps per workload and framework; None when no run has counts."""
    counted = [r for r in runs if "aten_ops_per_step" in r]
    if not counted:
        return None
    lines = ["| workload | framework | aten ops / step | kernel launches / step |", "|---|---|---|---|"]
    for model in models:
        for framework in frameworks:
            these = [r for r in counted if r["model"] == model and r["framework"] == framework]
            if these:
                ops = statistics.median(r["aten_ops_per_step"] for r in these)
                launches = statistics.median(r["launches_per_step"] for r in these)
                lines.append(f"| {workload_label(model)} | {labels[framework]} | {ops:.1f} | {launches:.1f} |")
    return "\n".join(lines)
