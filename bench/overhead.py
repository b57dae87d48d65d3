"""kiln vs a hand-written PyTorch loop: per-step time ratio and start-up cost.

    python bench/overhead.py [--steps 300] [--repeats 5]

Both loops do the same work per step (dataloader batch, forward, backward, clip to 1.0, AdamW,
linear schedule, zero_grad); kiln runs with its defaults: progress bar and logging on (every 50
steps here, so logging cost is included). Runs are interleaved (raw, kiln, raw, kiln, ...) in one
process and the median per-step time of each is compared, timing only steps after a warm-up.
Targets: ratio <= 1.10 on the tiny MLP (overhead-dominated), <= 1.02 on the small transformer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.models import MLP, SmallTransformer  # noqa: E402

WARMUP = 20


def mlp_data(n: int = 4096) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def lm_data(n: int = 512, seq: int = 128) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (n, seq + 1), generator=g)
    return [{"input_ids": ids[i, :-1], "labels": ids[i, 1:]} for i in range(n)]


def raw_loop(model: nn.Module, data: list, batch: int, steps: int) -> float:
    """The nanoGPT-style reference; returns seconds per step after the warm-up."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    model.train()
    step, t0 = 0, 0.0
    while step < steps:
        for b in loader:
            if step == WARMUP:
                t0 = time.perf_counter()
            loss = model(**b)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == steps:
                break
    return (time.perf_counter() - t0) / (steps - WARMUP)


def kiln_loop(model: nn.Module, data: list, batch: int, steps: int) -> float:
    from kiln import Callback, Trainer

    marks: dict[str, float] = {}

    class Clock(Callback):
        def on_step_begin(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == WARMUP:
                marks["start"] = time.perf_counter()

        def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == steps:
                marks["end"] = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        cfg = {
            "output_dir": out,
            "max_steps": steps,
            "per_device_train_batch_size": batch,
            "learning_rate": 1e-4,
            "logging_steps": 50,
            "save_strategy": "no",
            "dataloader_drop_last": True,
            "strategy": {"device": "cpu"},
        }
        Trainer(model, cfg, train_dataset=data, callbacks=[Clock()]).fit()
    return (marks["end"] - marks["start"]) / (steps - WARMUP)


def import_cost() -> tuple[float, float]:
    def best(stmt: str) -> float:
        times = []
        for _ in range(5):
            out = subprocess.run(
                [sys.executable, "-c", f"import time;t=time.perf_counter();{stmt};print(time.perf_counter()-t)"],
                capture_output=True,
                text=True,
                check=True,
            )
            times.append(float(out.stdout.strip().splitlines()[-1]))
        return min(times)

    return best("import torch"), best("import torch; import kiln")


def startup_cost(model_fn, data: list, batch: int) -> tuple[float, float]:
    """Seconds from nothing to the end of step 1: raw loop vs kiln Trainer."""
    t = time.perf_counter()
    raw_loop(model_fn(), data, batch, 1 + WARMUP)
    raw = time.perf_counter() - t
    t = time.perf_counter()
    kiln_loop(model_fn(), data, batch, 1 + WARMUP)
    return raw, time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cases = [
        ("tiny MLP", MLP, mlp_data(), 64, args.steps, 1.10),
        ("small transformer", SmallTransformer, lm_data(), 8, max(40, args.steps // 6), 1.02),
    ]
    for name, model_fn, data, batch, steps, target in cases:
        raw_t, kiln_t = [], []
        for _ in range(args.repeats):
            torch.manual_seed(0)
            raw_t.append(raw_loop(model_fn(), data, batch, steps))
            torch.manual_seed(0)
            kiln_t.append(kiln_loop(model_fn(), data, batch, steps))
        r, k = statistics.median(raw_t), statistics.median(kiln_t)
        ratio = k / r
        verdict = "OK" if ratio <= target else "OVER TARGET"
        print(
            f"{name:18s} raw {r * 1e3:8.3f} ms/step   kiln {k * 1e3:8.3f} ms/step   ratio {ratio:.3f} (target <= {target}) {verdict}"
        )
        raw_s, kiln_s = startup_cost(model_fn, data, batch)
        print(f"{'':18s} start-up to step {WARMUP + 1}: raw {raw_s:.2f} s, kiln {kiln_s:.2f} s")
    torch_s, kiln_s = import_cost()
    print(f"import kiln costs {kiln_s - torch_s:+.3f} s over import torch ({torch_s:.2f} s) (target <= 0.15 s)")


if __name__ == "__main__":
    main()
