"""kiln model_parallel (tensor parallel 2) vs a hand-written torchtitan-style TP loop, and the memory
tensor parallelism saves against FSDP, on 2 processes (gloo on CPU, NCCL on GPUs).

    python bench/model_parallel_overhead.py [--steps 60] [--repeats 3] [--mem-dim 2048] [--mem-layers 4]
        [--memory-only] [--allocator fixed-mmap|default]
    python bench/model_parallel_overhead.py --memory-only --nproc 4    # tp 2 x dp_shard 2 vs FSDP dp 4
    python bench/model_parallel_overhead.py --axis pp [--schedules gpipe 1f1b ...]   # bench/pipeline_overhead.py
    python bench/model_parallel_overhead.py --axis pp --nproc 4 --schedules 1f1b   # pp 2 x dp_shard 2
    python bench/model_parallel_overhead.py --axis ep [--steps 60] [--repeats 3]   # ep 2 vs a hand-written loop

1. Per-step time on a small Llama (LlamaConfig: hidden 128, 2 layers, 4 heads, vocab 256, sequences
   of 64, batch 8): kiln `strategy: {name: model_parallel, mesh: {tp: 2}, tp_plan: auto}` against
   the loop one writes by hand the way torchtitan does: one DeviceMesh with a `tp` axis,
   `parallelize_module` with the same plan (Llama's own: q/k/v/gate/up colwise, o/down rowwise, the
   embedding split by vocabulary, lm_head colwise with its output gathered), both ranks reading the
   same batches (one TP group is one data shard), the global gradient norm over the TP shards and the
   replicated norms clipped to 1.0 (one all-reduce, as kiln), AdamW and a linear schedule.
   Interleaved repeats; medians of the per-step times after a warm-up, on rank 0, in wall-clock and
   in this process's CPU time. Target: ratio <= 1.05.
2. Peak memory per rank for a model whose parameters + AdamW state dominate (`mem-layers` square
   Linear layers of `mem-dim`, a batch of 2): kiln model_parallel tp 2 (the layers split in
   colwise/rowwise pairs) vs kiln FSDP full_shard on 2 processes (each Linear one unit), each in a
   fresh job; measured as bench/fsdp_overhead.py does (CPU: the growth of ru_maxrss with glibc's
   mmap threshold pinned, see there; GPU: max_memory_allocated). Both hold half the parameters and
   optimizer state per rank; TP holds the whole batch's activations, split by feature, and no
   gathered layer. `--nproc 4`: tp 2 x dp_shard 2 (TP inside FSDP) against FSDP over 4 processes,
   each holding a quarter of the parameters and optimizer state.
3. `--axis ep`: per-step time of kiln `strategy: {name: model_parallel, mesh: {ep: 2}}` on a small
   Mixtral against a hand-written expert-parallel loop with the same all-to-all dispatch
   (bench/expert_parallel_loop.py); medians as in 1. Target: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ddp_overhead import TARGET, _durations, device, kiln_loop, lm_data  # noqa: E402
from bench.fsdp_overhead import measure_peak  # noqa: E402
from bench.fsdp_overhead import worker as run_worker

BATCH = 8


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def llama_plan(model: nn.Module) -> dict[str, Any]:
    """Llama's tensor-parallel plan written out by hand, as torchtitan's parallelize functions do."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def clip_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global 2-norm: TP shards' squares summed over the TP group, replicated tensors counted once."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    shards = [g._local_tensor for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.stack([s.pow(2).sum() for s in shards]).sum()
    dist.all_reduce(total)
    norm = (total + torch.stack([g.pow(2).sum() for g in whole]).sum()).sqrt()
    coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(shards + whole, coef)
    return norm


def raw_loop(model: nn.Module, data: list, steps: int) -> list[tuple[float, float]]:
    """The hand-written TP loop; (wall, cpu) seconds of each step after the warm-up."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    dev = device()
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = model.to(dev)
    parallelize_module(model, mesh["tp"], llama_plan(model))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    order = torch.Generator().manual_seed(0)  # the same order on every rank: one TP group, one data shard
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, generator=order, drop_last=True)
    model.train()
    step, ends = 0, []
    while step < steps:
        for b in loader:
            b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
            loss = model(**b).loss
            loss.backward()
            clip_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ends.append((time.perf_counter(), time.process_time()))
            if step == steps:
                break
    return _durations(ends)


def overhead(steps: int, repeats: int) -> None:
    data = lm_data(seq=64)
    tp = {"name": "model_parallel", "mesh": {"tp": 2}, "tp_plan": "auto"}
    raw_t: list[tuple[float, float]] = []
    kiln_t: list[tuple[float, float]] = []
    for _ in range(repeats):
        torch.manual_seed(0)
        raw_t += raw_loop(llama(), data, steps)
        torch.manual_seed(0)
        kiln_t += kiln_loop(llama(), data, BATCH, steps, strategy=tp)
    if dist.get_rank() == 0:
        for i, clock in ((0, "wall"), (1, "cpu ")):
            r, k = statistics.median(t[i] for t in raw_t), statistics.median(t[i] for t in kiln_t)
            verdict = "OK" if k / r <= TARGET else "OVER TARGET"
            print(
                f"llama 2x128 tp 2 {clock} hand-written {r * 1e3:8.3f} ms/step   kiln {k * 1e3:8.3f} ms/step   "
                f"ratio {k / r:.3f} (target <= {TARGET}) {verdict}",
                flush=True,
            )


def peak_memory(kind: str, dim: int, layers: int) -> None:
    """One kiln run under `kind` (tp2 or fsdp); rank 0 prints every rank's peak as JSON."""
    if kind in ("tp2", "tp2dp2"):
        plan = {f"layers.{i}": "colwise" if i % 2 == 0 else "rowwise" for i in range(layers)}
        mesh = {"tp": 2} if kind == "tp2" else {"dp_shard": 2, "tp": 2}
        strategy: dict[str, Any] = {"name": "model_parallel", "mesh": mesh, "tp_plan": plan}
    else:
        strategy = {"name": "fsdp", "wrap": ["Linear"]}
    measure_peak(
        kind,
        strategy,
        dim,
        layers,
        (
            "kiln.strategies.model_parallel.strategy",
            "kiln.strategies.fsdp.strategy",
            "torch.distributed.tensor.parallel",
            "torch.distributed.checkpoint.state_dict",
        ),
    )


def worker(args: argparse.Namespace) -> None:
    if args.axis == "pp":
        from bench import pipeline_overhead as pipe

        run_worker(args, pipe.peak_memory, lambda steps, repeats: pipe.overhead(steps, repeats, args.schedules))
    elif args.axis == "ep":
        from bench.expert_parallel_loop import ep_overhead

        run_worker(args, peak_memory, ep_overhead)
    else:
        run_worker(args, peak_memory, overhead)


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
        "--axis",
        args.axis,
        "--schedules",
        *args.schedules,
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))}
    if "--memory" in extra and args.allocator == "fixed-mmap" and not torch.cuda.is_available():
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mem-dim", type=int, default=2048)
    parser.add_argument("--mem-layers", type=int, default=4)
    parser.add_argument("--memory-only", action="store_true", help="skip the per-step comparison")
    parser.add_argument(
        "--allocator",
        choices=["fixed-mmap", "default"],
        default="fixed-mmap",
        help="CPU memory runs: pin glibc's mmap threshold (see bench/fsdp_overhead.py) or keep its default",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        choices=[2, 4],
        default=2,
        help="4: the memory pair tp 2 x dp_shard 2 vs FSDP dp 4; with --axis pp, the pp 2 x dp_shard 2 rows",
    )
    parser.add_argument(
        "--axis", choices=["tp", "pp", "ep"], default="tp", help="pp: the pipeline's rows; ep: the expert-parallel row"
    )
    parser.add_argument(
        "--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
    )
    parser.add_argument(
        "--memory", choices=["tp2", "tp2dp2", "fsdp", "pp2", "dp2"], default=None, help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return
    if not args.memory_only:
        if args.nproc != 2 and args.axis != "pp":
            raise SystemExit("the per-step comparison runs on 2 processes: add --memory-only to --nproc 4")
        print(_launch(args), end="", flush=True)
    if args.axis == "pp":
        if args.nproc == 2:  # the memory pair is pp 2 against dp 2
            pp_memory(args)
        return
    if args.axis == "ep":
        return
    peaks = {}
    tp_kind = "tp2" if args.nproc == 2 else "tp2dp2"
    for kind in (tp_kind, "fsdp"):
        line = next(x for x in _launch(args, "--memory", kind).splitlines() if x.startswith("PEAK "))
        peaks[kind] = json.loads(line[5:])["bytes"]
    params = args.mem_layers * (args.mem_dim * args.mem_dim + args.mem_dim)
    shown = {k: " / ".join(f"{b / 2**20:.1f}" for b in v) for k, v in peaks.items()}
    ranks = " / ".join(f"rank {r}" for r in range(args.nproc))
    tp_label = "tp 2" if args.nproc == 2 else "tp 2 x dp_shard 2"
    print(
        f"peak memory per rank ({ranks}), {params / 1e6:.1f}M parameters + AdamW: {tp_label} {shown[tp_kind]} MiB, "
        f"FSDP dp {args.nproc} {shown['fsdp']} MiB, ratio of the maxima {max(peaks[tp_kind]) / max(peaks['fsdp']):.2f} "
        f"(allocator: {'cuda' if torch.cuda.is_available() else args.allocator})",
        flush=True,
    )


def pp_memory(args: argparse.Namespace) -> None:
    peaks = {}
    for kind in ("pp2", "dp2"):
        line = next(x for x in _launch(args, "--memory", kind).splitlines() if x.startswith("PEAK "))
        peaks[kind] = json.loads(line[5:])["bytes"]
    shown = {k: " / ".join(f"{b / 2**20:.1f}" for b in v) for k, v in peaks.items()}
    d = args.mem_dim
    params = args.mem_layers * (4 * d * d + 3 * 2 * d * d + 2 * d) + 2 * 256 * d + d
    print(
        f"peak memory per rank (rank 0 / rank 1), Llama {args.mem_layers}x{d} ({params / 1e6:.1f}M parameters) + "
        f"AdamW: pp 2 {shown['pp2']} MiB, dp 2 (ddp) {shown['dp2']} MiB, ratio of the maxima "
        f"{max(peaks['pp2']) / max(peaks['dp2']):.2f} (allocator: "
        f"{'cuda' if torch.cuda.is_available() else args.allocator})",
        flush=True,
    )


if __name__ == "__main__":
    main()
