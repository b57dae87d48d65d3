"""AdamW step variants on this CPU (issue 33 item 3): `adamw_torch` (on CPU torch runs its per-parameter
for-loop kernels; kiln's default until HF's became the fused kernel), `adamw_torch_foreach`,
`adamw_torch_fused` (kiln's and HF's default on torch >= 2.8) and `adamw_torch` with
`train.torch_compile_optimizer_step: true` (inductor). Ratios are against `adamw_torch`.

    python bench/optimizer_step.py --rounds 5          # the figures in docs/benchmarks.md

Two figures per variant, each the median over the timed steps of one run, then the median (and the
min-max spread) of those over the rounds; the variants run interleaved, in a new random order each
round, in this process, on one CPU thread:
- `optimizer.step()` alone (the optimizer kiln builds, over the model's parameters with fixed
  random gradients): what the variant changes;
- kiln's whole training step (forward, backward, clipping, step, schedule) on the same model.
The compiled step is compiled in its first steps; both figures leave out a warm-up."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.models import SmallTransformer  # noqa: E402
from kiln import Callback, Trainer  # noqa: E402
from kiln.optim.optimizers import build_optimizer  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "adamw_torch": {"optim": "adamw_torch"},
    "adamw_torch_foreach": {"optim": "adamw_torch_foreach"},
    "adamw_torch_fused (default)": {"optim": "adamw_torch_fused"},
    "adamw_torch + compiled step": {"optim": "adamw_torch", "train": {"torch_compile_optimizer_step": True}},
}
WARMUP = 8
VOCAB, SEQ, BATCH = 256, 64, 16


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return SmallTransformer(vocab=VOCAB, dim=128, layers=2, seq=SEQ)


def step_alone(settings: dict[str, Any], steps: int) -> float:
    """Median seconds of `optimizer.step()` over `steps`, after the warm-up."""
    from kiln.engine.compile import compile_optimizer_step

    m = model()
    opt = build_optimizer(m, {"name": settings["optim"], "lr": 1e-3, "weight_decay": 0.01})
    if settings.get("train", {}).get("torch_compile_optimizer_step"):
        compile_optimizer_step(
            opt,
            None,
            type(
                "T",
                (),
                {"torch_compile_optimizer_step": True, "torch_compile_backend": None, "torch_compile_mode": None},
            )(),
        )
    g = torch.Generator().manual_seed(1)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    times = []
    for i in range(WARMUP + steps):
        start = time.perf_counter()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Clock(Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.stamps.append(time.perf_counter())


def kiln_step(settings: dict[str, Any], steps: int) -> float:
    """Median seconds of kiln's training step over `steps`, after the warm-up."""
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": (ids := torch.randint(0, VOCAB, (SEQ,), generator=g)), "labels": ids.roll(-1)}
        for _ in range((WARMUP + steps + 1) * BATCH)
    ]
    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        cfg = {
            "output_dir": out,
            "max_steps": WARMUP + steps + 1,
            "per_device_train_batch_size": BATCH,
            "learning_rate": 1e-3,
            "max_grad_norm": 1.0,
            "save": {"strategy": "no"},
            "log": {"disable_tqdm": True, "level": "error", "history": []},
            "strategy": {"device": "cpu"},
            **settings,
        }
        Trainer(model(), cfg, train_dataset=data, callbacks=[clock]).fit()
    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][WARMUP:]
    return statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[float]]] = {name: {"alone": [], "kiln": []} for name in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS)
        random.Random(r).shuffle(order)
        for name in order:
            torch._dynamo.reset()
            results[name]["alone"].append(step_alone(VARIANTS[name], args.steps * 3))
            torch._dynamo.reset()
            results[name]["kiln"].append(kiln_step(VARIANTS[name], args.steps))
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(
                f"{name}: {results[name]['alone'][-1] * 1e3:.3f} / {results[name]['kiln'][-1] * 1e3:.1f} ms"
                for name in VARIANTS
            ),
            file=sys.stderr,
            flush=True,
        )
    base = {k: statistics.median(results["adamw_torch"][k]) for k in ("alone", "kiln")}
    print(
        f"{'variant':30} {'optimizer.step() ms':>24} {'x adamw_torch':>14} {'kiln step ms':>22} {'x adamw_torch':>14}"
    )
    for name, res in results.items():
        cells = []
        for key in ("alone", "kiln"):
            med = statistics.median(res[key])
            cells.append(f"{med * 1e3:8.3f} ({min(res[key]) * 1e3:.3f}-{max(res[key]) * 1e3:.3f})")
            cells.append(f"{med / base[key]:.2f}")
        print(f"{name:30} {cells[0]:>24} {cells[1]:>14} {cells[2]:>22} {cells[3]:>14}")


if __name__ == "__main__":
    main()
