"""kiln's DeepSpeed strategy vs a hand-written `deepspeed.initialize` loop, and ZeRO-3's memory per rank.

    python bench/deepspeed_overhead.py [--steps 90] [--repeats 3] [--nproc 2] [--dim 128] [--mem-dim 512]
        [--parts overhead,ddp,deepspeed] [--allocator fixed-mmap|default]

Starts itself under `torch.distributed.run --standalone`, once per part:

- overhead: ZeRO-2 on the small transformer. Both loops use the same process group, model, per-device
  batch, DistributedSampler sharding, DeepSpeed config (ZeRO-2, clipping 1.0 inside DeepSpeed), torch
  AdamW and a linear schedule; kiln runs with `average_tokens_across_devices: false` (each rank's mean,
  as the hand-written loop has it), logging every 50 steps, no checkpoints. Runs are interleaved and the
  medians of the per-step times after a warm-up (pooled over repeats) are compared on rank 0 in
  wall-clock and CPU time. Target: ratio <= 1.05.
- memory: peak memory per rank of kiln DDP vs kiln ZeRO-3 on a model whose parameters, gradients
  and Adam state dominate (built whole on each rank, then partitioned by `deepspeed.initialize`:
  nn.TransformerEncoder deep-copies its layers, which DeepSpeed's zero.Init cannot partition) (the transformer at `--mem-dim`), each in its
  own launch: on CUDA `max_memory_allocated`, on CPU the peak resident set size above the process's
  size before the model was built. On CPU the memory launches pin glibc's mmap threshold
  (MALLOC_MMAP_THRESHOLD_=65536) so that the resident size tracks live tensors rather than freed blocks
  kept in per-thread heaps (see bench/fsdp_overhead.py); `--allocator default` keeps glibc's default.

The figures must be taken on a quiet machine (on a shared one, only the CPU-time ratio means much).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ddp_overhead import _durations, device, lm_data, timed_fit  # noqa: E402
from bench.models import SmallTransformer  # noqa: E402

TARGET = 1.05
LR = 1e-4


def ds_config(batch: int, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def raw_loop(model: torch.nn.Module, data: list, batch: int, steps: int) -> list[tuple[float, float]]:
    """A hand-written DeepSpeed ZeRO-2 loop; (wall, cpu) seconds of each step after the warm-up."""
    import deepspeed

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    engine, _, _, _ = deepspeed.initialize(
        model=model.to(device()), optimizer=opt, lr_scheduler=sched, config=ds_config(batch, 2)
    )
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
    engine.train()
    step, epoch, ends = 0, 0, []
    while step < steps:
        sampler.set_epoch(epoch)
        for b in loader:
            loss = engine(**{k: v.to(engine.device) for k, v in b.items()})["loss"]
            engine.backward(loss)
            engine.step()  # clips, steps the optimizer and the schedule, zeroes the gradients
            step += 1
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append((time.perf_counter(), time.process_time()))
            if step == steps:
                break
        epoch += 1
    return _durations(ends)


def kiln_run(
    model_fn, data: list, batch: int, steps: int, strategy: str, **extra
) -> tuple[list[tuple[float, float]], object]:
    cfg = {
        "max_steps": steps,
        "per_device_train_batch_size": batch,
        "learning_rate": LR,
        "max_grad_norm": 1.0,
        "logging_steps": 50,
        "save_strategy": "no",
        "dataloader_drop_last": True,
        "log": {"history": [], "disable_tqdm": True},
        "average_tokens_across_devices": False,
        "strategy": {"name": strategy},
        **extra,
    }
    return timed_fit(model_fn(), data, cfg)


def overhead(steps: int, repeats: int, dim: int) -> None:
    rank0 = dist.get_rank() == 0
    data, batch = lm_data(), 8
    model_fn = lambda: SmallTransformer(dim=dim, layers=2, seq=64)  # noqa: E731
    raw_t: list[tuple[float, float]] = []
    kiln_t: list[tuple[float, float]] = []
    for _ in range(repeats):
        torch.manual_seed(0)
        raw_t += raw_loop(model_fn(), data, batch, steps)
        torch.manual_seed(0)
        kiln_t += kiln_run(model_fn, data, batch, steps, "deepspeed_stage_2")[0]
    if rank0:
        print(
            f"world size {dist.get_world_size()}, {torch.get_num_threads()} threads per process, {repeats} interleaved repeats",
            flush=True,
        )
        for i, clock in ((0, "wall"), (1, "cpu ")):
            r, k = statistics.median(t[i] for t in raw_t), statistics.median(t[i] for t in kiln_t)
            verdict = "OK" if k / r <= TARGET else "OVER TARGET"
            print(
                f"ZeRO-2 transformer 2x{dim} {clock} hand-written {r * 1e3:8.3f} ms/step   kiln {k * 1e3:8.3f} ms/step"
                f"   ratio {k / r:.3f} (target <= {TARGET}) {verdict}",
                flush=True,
            )


def _resident_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory(strategy: str, steps: int, dim: int) -> None:
    """Peak memory of one kiln run on this rank, printed by every rank."""
    model_fn = lambda: SmallTransformer(dim=dim, layers=4, seq=64)  # noqa: E731
    extra = (
        {"deepspeed": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}}
        if strategy == "deepspeed"
        else {}
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = _resident_mb()
    _, trainer = kiln_run(model_fn, lm_data(n=64), 2, steps, strategy, **extra)
    if torch.cuda.is_available():
        peak = f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB allocated on the GPU"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before:.0f} MiB resident above the start"
    n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.model.parameters())
    print(f"memory {strategy:9s} rank {dist.get_rank()}: {n / 1e6:.1f}M parameters, peak {peak}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128, help="width of the transformer in the overhead part")
    parser.add_argument("--mem-dim", type=int, default=512, help="width of the transformer in the memory part")
    parser.add_argument("--parts", default="overhead,ddp,deepspeed", help="comma-separated: overhead, ddp, deepspeed")
    parser.add_argument(
        "--allocator",
        choices=["fixed-mmap", "default"],
        default="fixed-mmap",
        help="CPU memory runs: pin glibc's mmap threshold or keep its default",
    )
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed

        deepspeed.init_distributed(
            dist_backend="nccl" if torch.cuda.is_available() else "gloo"
        )  # kiln reuses this group
        if torch.cuda.is_available():
            torch.cuda.set_device(device())
        if args.part == "overhead":
            overhead(args.steps, args.repeats, args.dim)
        else:
            memory(args.part, max(3, args.steps // 10), args.mem_dim)
        dist.destroy_process_group()
        return
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc))),
    }
    for part in args.parts.split(","):  # the memory runs each in a fresh process: peaks do not mix
        part_env = dict(env)
        if part != "overhead" and args.allocator == "fixed-mmap" and not torch.cuda.is_available():
            part_env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
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
            "--dim",
            str(args.dim),
            "--mem-dim",
            str(args.mem_dim),
            "--part",
            part,
        ]
        code = subprocess.call(cmd, env=part_env)
        if code:
            sys.exit(code)


if __name__ == "__main__":
    main()
