"""Compiled training side by side (issue 33, item 2): a hand-written torch.compile loop, kiln, HF Trainer and
Lightning, each compiling the same model the same way, on the same work.

    python bench/compiled.py --rounds 2 --models mlp lm16             # the CPU figures in docs/benchmarks.md
    python bench/compiled.py --rounds 1 --steps 30                    # does it run (CPU: 20-40 s of compile a run)
    python bench/compiled.py --device cuda --models gpt lm16 --rounds 3 --budget 210 --json compiled.json   # a GPU
    python bench/compiled.py --table-from compiled.json               # the table again, from a run's raw results
    python bench/compiled.py --device cuda --frameworks kiln hand-written-hf-groups   # + the loop with 2 param groups
    python bench/compiled.py --models dec8 --frameworks kiln kiln-regional --rounds 2   # regional compile (issue 54)

How each compiles (--backend, default inductor, and --mode; fullgraph off: kiln and HF's arguments have none): the
loop `torch.compile(model, backend=..., mode=...)`, as kiln/engine/compile.py does; kiln `torch_compile: true` (+
`torch_compile_backend` / `_mode`); HF `TrainingArguments(torch_compile=True, torch_compile_backend=...,
torch_compile_mode=...)` (Accelerate compiles the model it prepares); Lightning `torch.compile` of the LightningModule
before `trainer.fit`, its documented way (it then compiles forward and training_step, the `self.log` call included).

Recipe and method are bench/compare.py's (shared helpers): AdamW without weight decay, linear schedule, clipping at
1.0, a log event every 10 steps; each framework in its own fresh process, in a new random order per round. On cuda all
run bf16 autocast (kiln `precision: bf16`, HF `bf16=True`, Lightning `"bf16-mixed"`, the loop `torch.autocast`) and
torch's default AdamW (HF's default, the fused one, is one Lightning refuses to clip under bf16-mixed). Per run: the
first step alone (where compilation lands), start-up (process start to the end of step 1), time per step after a
warm-up (CUDA synchronized at the marks read, nowhere else), aten operators and CUDA kernel launches per step counted
with torch.profiler over warm-up steps 2-10 (bench/counts.py), and dynamo's counters at the end: graphs compiled
(`unique_graphs`: recompiles and the pieces between graph breaks included) and graph breaks. Each run compiles into
an empty inductor and Triton cache of its own (`--cache cold`) or into one shared by the session (`--cache warm`).

Workloads: the tiny MLP and issue 33's small transformer (bench/compare.py's "mlp" and "lm16"); "dec8", the same
decoder with 8 blocks of width 128, 4 heads, 64 tokens, vocabulary 1024, batch 8 (regional against whole-model
compile: kiln-regional is kiln with `torch_compile: {regions: blocks}`, its ratios to kiln's whole-model compile
printed under the table); and, on a GPU only, "gpt": a GPT-style decoder (8 blocks of width 1024, 16 heads, 1024
tokens, vocabulary 32768, batch 8). For the
language models: tokens/s = batch * sequence / time per step, and on CUDA MFU = tokens/s * F / peak, where
F = 6 * N + 12 * layers * sequence * width is the FLOPs of one token's forward and backward (PaLM's appendix B,
nanoGPT's estimate_mfu): N counts every parameter that multiplies per token (all but the token and position
embeddings, which are lookups; the LM head is counted), the second term the attention scores and their weighted sum,
with no discount for the causal mask. The peak is --peak-tflops, by default the dense bf16 figure of the card the
workers report (H100/H200 SXM: 989 TFLOP/s). Runs use one CPU thread."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

from bench.compare import (  # noqa: E402
    FRAMEWORKS as BASE_FRAMEWORKS,
)
from bench.compare import (
    HAND_HF_GROUPS,
    LABELS,
    LOG_EVERY,
    LR,
    MODELS,
    WARMUP,
    Clock,
    build,
    hf_arguments,
    hf_marks,
    installed,
    kiln_marks,
    kiln_settings,
    lightning_arguments,
    lightning_module,
    linear,
    spread,
)
from bench.counts import StepCounter, counts_table  # noqa: E402
from bench.harness import compile_sources, run_worker  # noqa: E402

#: kiln with `torch_compile: {regions: blocks}`: each repeated block compiled once, the rest eager (issue 54 item 4)
KILN_REGIONAL = "kiln-regional"
FRAMEWORKS = (*BASE_FRAMEWORKS, HAND_HF_GROUPS, KILN_REGIONAL)
LABELS = {**LABELS, KILN_REGIONAL: "kiln, regions: blocks"}


class Workload(NamedTuple):
    """A group of rows; `steps` per run unless --steps says otherwise; seq 0: no tokens/s, no MFU."""

    label: str
    batch: int
    steps: int
    seq: int = 0
    layers: int = 0
    dim: int = 0
    cuda_only: bool = False


GPT = {"vocab": 32768, "dim": 1024, "layers": 8, "heads": 16, "seq": 1024}
#: regional against whole-model compile on a CPU: the GPU decoder's shape, 8 blocks, small enough to train here
DEC8 = {"vocab": 1024, "dim": 128, "layers": 8, "heads": 4, "seq": 64}
WORKLOADS = {
    "mlp": Workload("tiny MLP", MODELS["mlp"].batch, 2000),
    "lm16": Workload("transformer 2×128, 64 tokens", MODELS["lm16"].batch, 150, seq=64, layers=2, dim=128),
    "dec8": Workload(
        f"decoder {DEC8['layers']}×{DEC8['dim']}, {DEC8['seq']} tokens",
        8,
        60,
        seq=DEC8["seq"],
        layers=DEC8["layers"],
        dim=DEC8["dim"],
    ),
    "gpt": Workload(
        f"GPT {GPT['layers']}×{GPT['dim']}, {GPT['seq']} tokens",
        8,
        80,
        seq=GPT["seq"],
        layers=GPT["layers"],
        dim=GPT["dim"],
        cuda_only=True,
    ),
}
#: dense bf16 tensor-core peaks (TFLOP/s) by a piece of torch.cuda.get_device_name(); the first match wins
PEAKS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0))


class Setup(NamedTuple):
    """How every framework of one session runs: the device and what torch.compile is given."""

    device: str  # "cpu" or "cuda"
    backend: str
    mode: str | None

    @property
    def cuda(self) -> bool:  # on cuda every framework runs bf16 autocast
        return self.device == "cuda"

    def compile_kwargs(self) -> dict[str, Any]:  # kiln's compile_kwargs (fullgraph left off)
        return {"backend": self.backend, "mode": self.mode}


# -- the GPU workload: bench/models.py's Decoder ------------------------------------------------------------
def gpt_data(n: int = 1024, shape: dict[str, int] = GPT) -> list[dict[str, Any]]:
    """Random token ids; n covers 80 steps of 8 without an epoch boundary inside the timed steps."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (n, shape["seq"] + 1), generator=g)
    return [{"input_ids": ids[i, :-1], "labels": ids[i, 1:]} for i in range(n)]


def make(model: str) -> tuple[Any, Any]:
    """Model and dataset of a workload (seed 0), bench/compare.py's for the CPU workloads."""
    if model in ("gpt", "dec8"):
        torch.manual_seed(0)
        from bench.models import Decoder

        shape = GPT if model == "gpt" else DEC8
        return Decoder(**shape), gpt_data(shape=shape)
    return build(model)


def matmul_params(net: Any) -> int:
    """N of the MFU formula: every parameter but the embedding tables and a `pos` (position) parameter."""
    lookups = {id(m.weight) for m in net.modules() if isinstance(m, nn.Embedding)} | {id(getattr(net, "pos", None))}
    return sum(p.numel() for p in net.parameters() if id(p) not in lookups)


def flops_per_token(n_params: int, layers: int, seq: int, dim: int) -> float:
    return 6.0 * n_params + 12.0 * layers * seq * dim


def mfu(tokens_per_s: float, flops: float, peak_tflops: float) -> float:
    return tokens_per_s * flops / (peak_tflops * 1e12)


def default_peak(device_name: str) -> float | None:
    return next((tflops for piece, tflops in PEAKS if piece in device_name), None)


# -- one run (in its own process) ---------------------------------------------------------------
class SyncedClock(Clock):
    """compare.py's Clock, plus the first step alone; `sync` (CUDA synchronize) runs only at the marks read.
    `counter` (bench/counts.py) profiles warm-up steps 2 to WARMUP, after the compile and before the timing."""

    def __init__(self, launched: float, steps: int, sync: Callable[[], None], counter: Any = None) -> None:
        super().__init__(launched, steps)
        self.sync, self.began, self.first_step, self.counter = sync, 0.0, 0.0, counter

    def step_begin(self, done: int) -> None:
        if self.counter is not None:
            self.counter.step_begin(done)
        if done in (0, WARMUP):
            self.sync()
        if done == 0:
            self.began = time.perf_counter()
        super().step_begin(done)

    def step_end(self, done: int) -> None:
        if done in (1, self.steps):
            self.sync()
        if done == 1:
            self.first_step = time.perf_counter() - self.began
        super().step_end(done)

    def result(self) -> dict[str, float]:
        return {**super().result(), "first_step": self.first_step}


def loader(data: Any, batch: int, s: Setup) -> Any:
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, pin_memory=s.cuda)


def run_hand_written(
    model: str, net: Any, data: Any, steps: int, clock: SyncedClock, out: str, s: Setup, hf_groups: bool = False
) -> None:
    net.to(s.device)
    compiled = torch.compile(net, **s.compile_kwargs())
    if hf_groups:
        from kiln.optim.optimizers import parameter_groups

        params: Any = parameter_groups(net, 0.0)
    else:
        params = net.parameters()
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)  # kiln's and HF's default (torch's is 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear(steps))
    # one context object, entered each step: on CPU (fp32) the loop pays for no autocast it does not use
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if s.cuda else contextlib.nullcontext()
    batches = loader(data, WORKLOADS[model].batch, s)
    compiled.train()
    step = 0
    while step < steps:
        for b in batches:
            clock.step_begin(step)
            if s.cuda:
                b = {k: v.to(s.device, non_blocking=True) for k, v in b.items()}
            with autocast:
                loss = compiled(**b)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % LOG_EVERY == 0:
                loss.item()  # what logging costs at least: reading the loss
            clock.step_end(step)
            if step == steps:
                break


def run_kiln(
    model: str, net: Any, data: Any, steps: int, clock: SyncedClock, out: str, s: Setup, regions: str | None = None
) -> None:
    from kiln import Trainer

    config = {
        **kiln_settings(WORKLOADS[model].batch, steps, out, device=s.device),
        "torch_compile": True,
        "torch_compile_backend": s.backend,
        "torch_compile_mode": s.mode,
    }
    if regions is not None:  # the section and HF's flat switch together, as a user would write them
        config = {**config, "train": {"torch_compile": True}, "torch_compile": {"regions": regions}}
    if s.cuda:
        config["precision"] = {"name": "bf16"}
    Trainer(net, config, train_dataset=data, callbacks=[kiln_marks(clock)]).fit()


def run_hf(model: str, net: Any, data: Any, steps: int, clock: SyncedClock, out: str, s: Setup) -> None:
    from transformers import Trainer, TrainingArguments

    args = hf_arguments(
        WORKLOADS[model].batch,
        steps,
        out,
        use_cpu=not s.cuda,
        bf16=s.cuda,
        optim="adamw_torch",
        torch_compile=True,
        torch_compile_backend=s.backend,
        torch_compile_mode=s.mode,
    )
    Trainer(model=net, args=TrainingArguments(**args), train_dataset=data, callbacks=[hf_marks(clock)]).train()


def run_lightning(model: str, net: Any, data: Any, steps: int, clock: SyncedClock, out: str, s: Setup) -> None:
    import lightning as L

    trainer = L.Trainer(
        **lightning_arguments(
            steps, out, clock, accelerator="gpu" if s.cuda else "cpu", precision="bf16-mixed" if s.cuda else "32-true"
        )
    )
    module = lightning_module(net, steps)
    if torch.__version__ >= (2, 12) and not hasattr(type(module).log, "_torchdynamo_disable"):
        # Lightning's fix (Lightning-AI/pytorch-lightning#21837) where the release lacks it: from torch 2.12 dynamo
        # fails in `self.log`'s signature check ("'method' object has no attribute '__dict__'"); it runs `log` eagerly
        module.log = torch.compiler.disable(module.log)
    trainer.fit(torch.compile(module, **s.compile_kwargs()), loader(data, WORKLOADS[model].batch, s))


RUNNERS = {
    "hand-written": run_hand_written,
    "kiln": run_kiln,
    "hf": run_hf,
    "lightning": run_lightning,
    HAND_HF_GROUPS: lambda *a: run_hand_written(*a, hf_groups=True),
    KILN_REGIONAL: lambda *a: run_kiln(*a, regions="blocks"),
}


def worker(framework: str, model: str, steps: int, launched: float, s: Setup) -> None:
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    counter = StepCounter(2, WARMUP, s.cuda)
    clock = SyncedClock(launched, steps, torch.cuda.synchronize if s.cuda else lambda: None, counter)
    net, data = make(model)
    w = WORKLOADS[model]  # the FLOPs of one token, counted before a framework wraps the model
    flops = flops_per_token(matmul_params(net), w.layers, w.seq, w.dim) if w.seq else 0.0
    with tempfile.TemporaryDirectory() as out:
        RUNNERS[framework](model, net, data, steps, clock, out, s)
    result: dict[str, Any] = {
        **clock.result(),
        **counter.counts,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "flops_per_token": flops,
        "device_name": torch.cuda.get_device_name() if s.cuda else "cpu",
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if s.cuda else 0.0,
    }
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver ---------------------------------------------------------------------------------
def one_run(framework: str, model: str, steps: int, s: Setup, cache: str, timeout: float | None) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "TOKENIZERS_PARALLELISM": "false",
        "TORCHINDUCTOR_CACHE_DIR": cache,
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
    }
    argv = ["--worker", framework, "--models", model, "--steps", str(steps), "--device", s.device]
    argv += ["--backend", s.backend] + (["--mode", s.mode] if s.mode else [])
    return run_worker(__file__, argv, env, f"{framework} on {model}", timeout)


def cell(values: list[float], fmt: str, suffix: str = "") -> str:
    return spread(values, fmt) + suffix if values else "–"  # a column that has no figure for this row


def table(report: dict[str, Any], peak_tflops: float | None) -> str:
    """The markdown table of a session's raw results (`report`, as --json writes it)."""
    runs, names = report["runs"], sorted({r["device_name"] for r in report["runs"]})
    peak = peak_tflops or (default_peak(names[0]) if report["device"] == "cuda" and len(names) == 1 else None)
    lines = [
        f"{len({r['round'] for r in runs})} round(s) on {', '.join(names)}; medians (min–max over rounds); "
        f"backend {report['backend']}, mode {report['mode'] or 'default'}, cache {report['cache']}; {WARMUP} "
        "warm-up steps not timed" + (f"; MFU against {peak:g} TFLOP/s" if peak else "") + "\n",
        "| workload | framework | first step (s) | start-up (s) | ms / step | ratio to hand-written | CPU-time ratio "
        "| tokens/s | MFU | graphs / breaks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in report["models"]:
        w = WORKLOADS[model]
        base = {r["round"]: r for r in runs if r["model"] == model and r["framework"] == "hand-written"}
        for framework in FRAMEWORKS:
            these = [r for r in runs if r["model"] == model and r["framework"] == framework]
            if not these:
                continue
            tokens = [w.batch * w.seq / r["per_step"] for r in these] if w.seq else []
            use = [100 * mfu(t, these[0]["flops_per_token"], peak) for t in tokens] if peak else []
            lines.append(
                " | ".join(
                    [
                        f"| {w.label} ({these[0]['steps']} steps)",
                        LABELS[framework],
                        cell([r["first_step"] for r in these], ".2f"),
                        cell([r["startup"] for r in these], ".2f"),
                        cell([r["per_step"] * 1e3 for r in these], ".3f"),
                        cell(
                            [r["per_step"] / base[r["round"]]["per_step"] for r in these if r["round"] in base], ".3f"
                        ),
                        cell(
                            [
                                r["cpu_per_step"] / base[r["round"]]["cpu_per_step"]
                                for r in these
                                if r["round"] in base and "cpu_per_step" in r
                            ],
                            ".3f",
                        ),  # absent from older --json files
                        cell(tokens, ",.0f"),
                        cell(use, ".2f", " %"),
                        ", ".join(sorted({f"{r['graphs']} / {r['breaks']}" for r in these})) + " |",
                    ]
                )
            )
    lines += regional_ratios(report)
    counted = counts_table(runs, report["models"], FRAMEWORKS, LABELS, lambda m: WORKLOADS[m].label)
    lines += [f"\nCounted over warm-up steps 2-{WARMUP} (torch.profiler; medians):\n\n{counted}"] if counted else []
    skipped = ", ".join(LABELS[f] for f in report["skipped"])
    lines += [f"\nNot installed, skipped: {skipped}."] if skipped else []
    lines += [f"\n{report['stopped']}"] if report["stopped"] else []
    lines += [f"\nFailed: {failure}" for failure in report.get("failed", [])]
    return "\n".join(lines)


def regional_ratios(report: dict[str, Any]) -> list[str]:
    """Regional over whole-model compile, per workload and round (first step: the compile; ms / step: steady)."""
    lines = []
    for model in report["models"]:
        rows = {(r["framework"], r["round"]): r for r in report["runs"] if r["model"] == model}
        pairs = [
            (rows[(KILN_REGIONAL, k)], rows[("kiln", k)]) for f, k in rows if f == KILN_REGIONAL and ("kiln", k) in rows
        ]
        if pairs:
            first = cell([a["first_step"] / b["first_step"] for a, b in pairs], ".3f")
            steady = cell([a["per_step"] / b["per_step"] for a, b in pairs], ".3f")
            lines.append(
                f"\n{WORKLOADS[model].label}: kiln regions: blocks / whole model: first step {first}, ms / step {steady}"
            )
    return lines


def save(report: dict[str, Any], path: str | None) -> None:
    """Written after every run, so a session cut short still leaves what it measured."""
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)


def measure(report: dict[str, Any], args: argparse.Namespace, setup: Setup, frameworks: list[str]) -> None:
    """Fill report["runs"], saving after each run, until the rounds or the --budget are spent."""
    rng, started, longest = random.Random(0), time.time(), {}  # longest: the slowest run so far, per workload
    with tempfile.TemporaryDirectory() as caches:
        for r in range(args.rounds):
            jobs = [(f, m) for m in report["models"] for f in frameworks]
            rng.shuffle(jobs)
            for framework, model in jobs:
                elapsed = time.time() - started
                if args.budget and elapsed + longest.get(model, 0.0) > args.budget:
                    report["stopped"] = f"Stopped by --budget {args.budget:g} s in round {r + 1}: rounds are partial."
                    return
                cache = os.path.join(caches, "shared" if args.cache == "warm" else f"{r}-{framework}-{model}")
                steps = max(WARMUP + 20, args.steps or WORKLOADS[model].steps)
                try:  # a failed or overlong run (a framework's compile error) must not lose the session's other runs
                    run = one_run(framework, model, steps, setup, cache, args.budget - elapsed if args.budget else None)
                    report["runs"].append({"round": r, "model": model, "framework": framework, "steps": steps, **run})
                    print(f"  {framework} on {model}: {json.dumps(run)}", file=sys.stderr, flush=True)
                except SystemExit as failed:
                    print(failed, file=sys.stderr, flush=True)
                    lines = str(failed).splitlines()
                    error = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)] or lines[-1:]
                    report["failed"].append(f"round {r + 1}: {lines[0]} {error[-1]}")
                if args.cache == "cold":
                    shutil.rmtree(cache, ignore_errors=True)  # a GPU model's kernels would fill the disk
                longest[model] = max(longest.get(model, 0.0), time.time() - started - elapsed)
                save(report, args.json)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="steps per run of every workload (default: each its own; >= 30)")
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), help="default: mlp lm16 (+ gpt on cuda)")
    parser.add_argument(
        "--frameworks",
        nargs="+",
        default=list(BASE_FRAMEWORKS),
        choices=list(FRAMEWORKS),
        help=f"the hand-written loop always runs; {HAND_HF_GROUPS}: it again with HF's two param groups",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of every framework")
    parser.add_argument("--mode", help="torch.compile mode of every framework (default: torch's default)")
    parser.add_argument(
        "--cache",
        default="cold",
        choices=("cold", "warm"),
        help="cold: an empty inductor cache per run; warm: one cache shared by the session's runs",
    )
    parser.add_argument("--peak-tflops", type=float, help="the accelerator's peak for MFU (default: by device name)")
    parser.add_argument("--budget", type=float, help="seconds: start no run that would likely end past this")
    parser.add_argument("--json", help="write the raw per-run results here (after every run)")
    parser.add_argument("--table-from", help="print the table of a --json file and stop")
    parser.add_argument("--worker", choices=list(FRAMEWORKS), help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table_from:
        with open(args.table_from) as f:
            return print(table(json.load(f), args.peak_tflops))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    setup = Setup(args.device, args.backend, args.mode)
    if args.worker:
        return worker(args.worker, args.models[0], args.steps, args.launched, setup)

    models = args.models or [m for m, w in WORKLOADS.items() if setup.cuda or not w.cuda_only]
    if not setup.cuda and any(WORKLOADS[m].cuda_only for m in models):
        raise SystemExit("workload gpt needs a GPU: run it with --device cuda (or drop it from --models).")
    compile_sources()
    frameworks = ["hand-written"] + [f for f in args.frameworks if f != "hand-written" and installed(f)]
    report: dict[str, Any] = {
        "device": setup.device,
        "backend": setup.backend,
        "mode": setup.mode,
        "cache": args.cache,
        "models": models,
        "skipped": [f for f in args.frameworks if f not in frameworks],
        "runs": [],
        "stopped": "",
        "failed": [],
    }
    measure(report, args, setup, frameworks)
    save(report, args.json)
    print(table(report, args.peak_tflops))


if __name__ == "__main__":
    main()
