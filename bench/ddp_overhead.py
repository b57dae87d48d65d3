"""kiln DDP vs a hand-written DDP loop: per-step time ratio on 2 processes (gloo on CPU, NCCL on GPUs).

    python bench/ddp_overhead.py [--steps 200] [--repeats 5] [--nproc 2]

Starts itself under `torch.distributed.run --standalone`. Both loops use the same process group,
model, per-device batch, DistributedSampler-style sharding, DDP settings (find_unused_parameters
off, as a hand-written loop would have it), clipping to 1.0, AdamW and a linear schedule. kiln runs
with its defaults otherwise (progress bar, logging every 50 steps, the per-step all-reduce of item
counts that makes token-level losses exact). Each case runs twice: kiln's default (the loss is the
mean over the labelled items of the global batch, which takes one scalar all-reduce per step) against
a hand-written loop that does the same, and `average_tokens_across_devices: false` (each rank's mean,
averaged by DDP) against the plain hand-written loop. Runs are interleaved (raw, kiln, raw, kiln,
...) and the medians of the per-step times after a warm-up (pooled over repeats) are compared on
rank 0, both in wall-clock time and in this process's CPU time (which other jobs on a shared machine
do not inflate). A last line per model shows kiln with HF's default `find_unused_parameters=True`
(what `strategy: ddp` did when the option was unset, before kiln chose it on the first step).
`--unused-only` compares instead find_unused_parameters unset (kiln's choice on the first step),
true and false, on the MLP and on the MLP with an unused head.
Target: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.models import MLP, SmallTransformer  # noqa: E402

WARMUP = 20
TARGET = 1.05


def mlp_data(n: int = 8192) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def lm_data(n: int = 1024, seq: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (n, seq + 1), generator=g)
    return [{"input_ids": ids[i, :-1], "labels": ids[i, 1:]} for i in range(n)]


def device() -> torch.device:
    return (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )


def _durations(ends: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of each step after the warm-up, from (wall, cpu) clock readings at step ends."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(ends[WARMUP:], ends[WARMUP + 1 :])]


def ddp_wrap(model: nn.Module, find_unused: bool = False) -> nn.Module:
    dev = device()
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[dev.index] if dev.type == "cuda" else None, find_unused_parameters=find_unused
    )


def raw_loop(
    model: nn.Module,
    data: list,
    batch: int,
    steps: int,
    token_exact: bool = False,
    wrap: Callable[[nn.Module], nn.Module] = ddp_wrap,
    find_unused: bool = False,
) -> list[tuple[float, float]]:
    """A hand-written DDP loop; (wall, cpu) seconds of each step after the warm-up. CPU time (this
    process) is insensitive to other jobs on a shared machine; wall time is what users wait for.

    token_exact: normalise by the labelled items summed over ranks, as kiln (and HF's
    average_tokens_across_devices) does by default: one scalar all-reduce per step, written the way
    one would by hand (counted and reduced before the forward). `wrap`: DDP, or another wrapper
    (bench/fsdp_overhead.py's fully_shard)."""
    dev = device()
    ddp = ddp_wrap(model.to(dev), find_unused=True) if find_unused else wrap(model.to(dev))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
    ddp.train()
    step, epoch, ends = 0, 0, []
    while step < steps:
        sampler.set_epoch(epoch)
        for b in loader:
            b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
            if token_exact:
                local = b["labels"].ne(-100).sum()
                total = local.clone()
                dist.all_reduce(total)
                loss = ddp(**b)["loss"] * (local * dist.get_world_size() / total)
            else:
                loss = ddp(**b)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ends.append((time.perf_counter(), time.process_time()))
            if step == steps:
                break
        epoch += 1
    return _durations(ends)


def timed_fit(model: nn.Module, data: list, cfg: dict) -> tuple[list[tuple[float, float]], object]:
    """kiln's Trainer.fit over `data` with `cfg` (and an output_dir made here); (wall, cpu) seconds of
    each step after the warm-up, and the Trainer."""
    from kiln import Callback, Trainer

    ends: list[tuple[float, float]] = []

    class Clock(Callback):
        def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append((time.perf_counter(), time.process_time()))

    # one output_dir for every rank (kiln refuses ranks that disagree), made by rank 0
    made = [tempfile.mkdtemp(prefix="kiln-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    out = made[0]
    try:
        trainer = Trainer(model, {"output_dir": out, **cfg}, train_dataset=data, callbacks=[Clock()])
        trainer.fit()
    except BaseException:
        # no barrier here: a rank that failed mid-window would wait in it for the ranks still blocked on
        # its pipeline sends, and they for it; exiting lets the launcher stop them
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
        raise
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    return _durations(ends), trainer


class MLPWithUnusedHead(nn.Module):
    """The MLP plus a head that forward never uses: DDP needs find_unused_parameters for it."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(64, 256, 10)
        self.unused_head = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.mlp(x, labels)


def unused_choice(steps: int, repeats: int, rank0: bool) -> None:
    """find_unused_parameters left unset (kiln decides on the first step) against forcing it either
    way, on a model where every parameter gets a gradient and on one with an unused head; the
    hand-written loop (flag off, or on where the model needs it) is the reference."""
    data, batch = mlp_data(), 64
    cases = [
        ("MLP, all used", lambda: MLP(64, 256, 10), False, (None, False, True)),
        ("MLP + unused head", MLPWithUnusedHead, True, (None, True)),
    ]
    for name, model_fn, needs, choices in cases:
        times: dict[str, list[tuple[float, float]]] = {"hand-written": []}
        for _ in range(repeats):
            torch.manual_seed(0)
            times["hand-written"] += raw_loop(model_fn(), data, batch, steps, find_unused=needs)
            for choice in choices:
                torch.manual_seed(0)
                times.setdefault(f"kiln find_unused={'unset' if choice is None else choice}", []).extend(
                    kiln_loop(model_fn(), data, batch, steps, find_unused=choice)
                )
        if rank0:
            ref = statistics.median(t[0] for t in times["hand-written"])
            for label, ts in times.items():
                m = statistics.median(t[0] for t in ts)
                print(f"{name:18s} {label:26s} {m * 1e3:8.3f} ms/step wall   ratio {m / ref:.3f}", flush=True)


def kiln_loop(
    model: nn.Module,
    data: list,
    batch: int,
    steps: int,
    find_unused: bool | None = False,
    token_exact: bool = True,
    strategy: dict | None = None,
) -> list[tuple[float, float]]:
    cfg = {
        "max_steps": steps,
        "per_device_train_batch_size": batch,
        "learning_rate": 1e-4,
        "logging_steps": 50,
        "save_strategy": "no",
        "dataloader_drop_last": True,
        "log": {"history": []},
        "strategy": strategy or {"name": "ddp", "find_unused_parameters": find_unused},
        "average_tokens_across_devices": token_exact,
    }
    return timed_fit(model, data, cfg)[0]


def worker(steps: int, repeats: int, unused_only: bool = False) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # kiln reuses this group
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    rank0 = dist.get_rank() == 0
    if unused_only:
        unused_choice(steps, repeats, rank0)
        dist.destroy_process_group()
        return
    cases = [
        ("MLP 64-256-256-10", lambda: MLP(64, 256, 10), mlp_data(), 64, steps),
        ("transformer 2x128", lambda: SmallTransformer(dim=128, layers=2, seq=64), lm_data(), 8, max(60, steps // 3)),
    ]
    if rank0:
        print(
            f"world size {dist.get_world_size()}, backend {dist.get_backend()}, {torch.get_num_threads()} threads per process,"
            f" {repeats} interleaved repeats",
            flush=True,
        )
    # (label, kiln options, hand-written loop options): kiln's default normalises by the items of the
    # global batch; a hand-written loop doing the same needs the same count all-reduce
    variants = [
        ("token-exact (default)", {}, {"token_exact": True}),
        ("average_tokens_across_devices=false", {"token_exact": False}, {}),
    ]
    for name, model_fn, data, batch, n in cases:
        for label, kiln_opts, raw_opts in variants:
            raw_t: list[tuple[float, float]] = []
            kiln_t: list[tuple[float, float]] = []
            for _ in range(repeats):
                torch.manual_seed(0)
                raw_t += raw_loop(model_fn(), data, batch, n, **raw_opts)
                torch.manual_seed(0)
                kiln_t += kiln_loop(model_fn(), data, batch, n, **kiln_opts)
            if rank0:
                for i, clock in ((0, "wall"), (1, "cpu ")):
                    r, k = statistics.median(t[i] for t in raw_t), statistics.median(t[i] for t in kiln_t)
                    verdict = "OK" if k / r <= TARGET else "OVER TARGET"
                    print(
                        f"{name:18s} {label:36s} {clock} hand-written {r * 1e3:8.3f} ms/step   kiln {k * 1e3:8.3f} ms/step"
                        f"   ratio {k / r:.3f} (target <= {TARGET}) {verdict}",
                        flush=True,
                    )
        torch.manual_seed(0)
        hf_default = kiln_loop(model_fn(), data, batch, n, find_unused=True)
        if rank0:
            print(
                f"{name:18s} kiln with find_unused_parameters=True (HF's default): "
                f"{statistics.median(t[0] for t in hf_default) * 1e3:.3f} ms/step wall",
                flush=True,
            )
    one = torch.ones((), device=device())
    times = []
    for _ in range(500):
        t = time.perf_counter()
        dist.all_reduce(one)
        times.append(time.perf_counter() - t)
    if rank0:
        print(
            f"one scalar all_reduce (kiln's per-step item count): {statistics.median(times) * 1e6:.0f} us median",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--unused-only",
        action="store_true",
        help="only compare find_unused_parameters unset / true / false, with and without unused parameters",
    )
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        worker(args.steps, args.repeats, args.unused_only)
        return
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        __file__,
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
    ] + (["--unused-only"] if args.unused_only else [])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc))),
    }
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
