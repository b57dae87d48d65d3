"""kiln FSDP vs a hand-written FSDP2 loop, and FSDP's memory saving, on 2 processes (gloo on CPU,
NCCL on GPUs).

    python bench/fsdp_overhead.py [--steps 60] [--repeats 3] [--nproc 2] [--mem-dim 2048] [--mem-layers 4]
        [--memory-only] [--allocator fixed-mmap|default]

1. Per-step time on the small transformer (bench/models.py): every encoder layer is one FSDP unit
   plus the root, AdamW, clipping to 1.0, a linear schedule, DistributedSampler-style sharding and
   kiln's default loss normalisation (items of the global batch: one scalar all-reduce per step,
   done by hand in the hand-written loop too). Interleaved repeats; the medians of the per-step
   times after a warm-up are compared on rank 0, in wall-clock and in this process's CPU time.
   Target: ratio <= 1.05.
2. Peak memory per rank for a model whose parameters + AdamW state dominate (an MLP of `mem-layers`
   square layers of `mem-dim`, a batch of 2): kiln FSDP full_shard vs kiln DDP, each in a fresh
   job. On GPUs: torch.cuda.max_memory_allocated; on CPU: the growth of the process's peak resident
   memory (ru_maxrss) from just before the model is built. Target: FSDP <= 0.6x DDP.
   On CPU the resident size only tracks live tensors if freed tensors go back to the system: glibc's
   malloc raises its mmap threshold after each large free (up to 32 MiB), after which same-sized
   blocks come from per-thread heaps that keep freed memory. FSDP frees a gathered layer every
   forward/backward (and gloo's threads allocate in their own heaps), so with the default the
   resident size counts every layer ever gathered, not what is live. The memory launches therefore
   set MALLOC_MMAP_THRESHOLD_=65536 (a fixed threshold: blocks above 64 KiB are mmapped and unmapped
   on free) for both strategies; `--allocator default` measures with glibc's default instead (then
   FSDP shows more resident memory than DDP: 16.8M parameters, 644 vs 468 MiB).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ddp_overhead import TARGET, device, kiln_loop, lm_data, raw_loop  # noqa: E402
from bench.models import SmallTransformer  # noqa: E402

MEMORY_TARGET = 0.6


def fsdp_wrap(model: nn.Module) -> nn.Module:
    """What a hand-written FSDP2 loop does: each encoder layer one unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.body.layers:
        fully_shard(layer)
    return fully_shard(model)


def overhead(steps: int, repeats: int) -> None:
    rank0 = dist.get_rank() == 0
    data = lm_data()
    fsdp = {"name": "fsdp", "wrap": ["TransformerEncoderLayer"]}
    raw_t: list[tuple[float, float]] = []
    kiln_t: list[tuple[float, float]] = []
    for _ in range(repeats):
        torch.manual_seed(0)
        raw_t += raw_loop(SmallTransformer(dim=128, layers=2, seq=64), data, 8, steps, token_exact=True, wrap=fsdp_wrap)
        torch.manual_seed(0)
        kiln_t += kiln_loop(SmallTransformer(dim=128, layers=2, seq=64), data, 8, steps, strategy=fsdp)
    if rank0:
        for i, clock in ((0, "wall"), (1, "cpu ")):
            r, k = statistics.median(t[i] for t in raw_t), statistics.median(t[i] for t in kiln_t)
            verdict = "OK" if k / r <= TARGET else "OVER TARGET"
            print(
                f"transformer 2x128 FSDP full_shard {clock} hand-written {r * 1e3:8.3f} ms/step   kiln {k * 1e3:8.3f} "
                f"ms/step   ratio {k / r:.3f} (target <= {TARGET}) {verdict}",
                flush=True,
            )


class Wide(nn.Module):
    """Parameters and optimizer state dominate: square layers, a tiny batch."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return {"loss": F.mse_loss(x, labels)}


def peak_memory(kind: str, dim: int, layers: int) -> None:
    """One kiln run under `kind` (ddp or fsdp); rank 0 prints every rank's peak as JSON."""
    # both strategies' code loaded before the baseline: imports are resident memory too (FSDP's pull in DTensor, DCP)
    measure_peak(
        kind,
        {"name": kind, **({"wrap": ["Linear"]} if kind == "fsdp" else {})},
        dim,
        layers,
        ("kiln.strategies.ddp.strategy", "kiln.strategies.fsdp.strategy", "torch.distributed.checkpoint.state_dict"),
    )


def measure_peak(kind: str, strategy: dict[str, Any], dim: int, layers: int, preload: tuple[str, ...]) -> None:
    """One kiln run of `Wide` under `strategy`, after importing `preload`; rank 0 prints every rank's peak
    (above the baseline taken just before the run) as JSON. Shared with bench/model_parallel_overhead.py."""
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(dim, generator=g), "labels": torch.randn(dim, generator=g)} for _ in range(16)]
    for name in preload:
        importlib.import_module(name)
    report_peak(kind, lambda: kiln_loop(Wide(dim, layers), data, 2, 4, token_exact=False, strategy=strategy))


def report_peak(kind: str, run: Callable[[], Any]) -> None:
    """`run()`'s peak memory above the baseline taken just before it, every rank's, printed by rank 0 as
    JSON (the growth of ru_maxrss on CPU, max_memory_allocated on GPUs). Shared with bench/pipeline_overhead.py."""
    dev = device()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run()
    peak = (
        torch.cuda.max_memory_allocated()
        if dev.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ) - base
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, peak)
    if dist.get_rank() == 0:
        print("PEAK " + json.dumps({"kind": kind, "bytes": every}), flush=True)


def worker(
    args: argparse.Namespace,
    peak: Callable[[str, int, int], None] = peak_memory,
    timed: Callable[[int, int], None] = overhead,
) -> None:
    """One rank of a bench job: the peak-memory run that `--memory` names, else the timed rounds."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # kiln reuses this group
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    if args.memory:
        peak(args.memory, args.mem_dim, args.mem_layers)
    else:
        if dist.get_rank() == 0:
            print(
                f"world size {dist.get_world_size()}, backend {dist.get_backend()}, {torch.get_num_threads()} threads "
                f"per process, {args.repeats} interleaved repeats of {args.steps} steps",
                flush=True,
            )
        timed(args.steps, args.repeats)
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, *extra: str) -> str:
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
        "--mem-dim",
        str(args.mem_dim),
        "--mem-layers",
        str(args.mem_layers),
        *extra,
    ]
    threads = str(max(1, (os.cpu_count() or 1) // args.nproc))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    if "--memory" in extra and args.allocator == "fixed-mmap" and not torch.cuda.is_available():
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mem-dim", type=int, default=2048)
    parser.add_argument("--mem-layers", type=int, default=4)
    parser.add_argument("--memory-only", action="store_true", help="skip the per-step comparison")
    parser.add_argument(
        "--allocator",
        choices=["fixed-mmap", "default"],
        default="fixed-mmap",
        help="CPU memory runs: pin glibc's mmap threshold (see the docstring) or keep its default",
    )
    parser.add_argument("--memory", choices=["ddp", "fsdp"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return
    if not args.memory_only:
        print(_launch(args), end="", flush=True)
    peaks = {}
    for kind in ("ddp", "fsdp"):
        line = next(x for x in _launch(args, "--memory", kind).splitlines() if x.startswith("PEAK "))
        peaks[kind] = max(json.loads(line[5:])["bytes"])
    params = args.mem_layers * (args.mem_dim * args.mem_dim + args.mem_dim)
    ratio = peaks["fsdp"] / peaks["ddp"]
    print(
        f"peak memory per rank, {params / 1e6:.1f}M parameters + AdamW: DDP {peaks['ddp'] / 2**20:.1f} MiB, "
        f"FSDP full_shard {peaks['fsdp'] / 2**20:.1f} MiB, ratio {ratio:.2f} (target <= {MEMORY_TARGET}; "
        f"allocator: {'cuda' if torch.cuda.is_available() else args.allocator}) "
        f"{'OK' if ratio <= MEMORY_TARGET else 'OVER TARGET'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
