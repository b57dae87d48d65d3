"""The CUDA paths that CI cannot run, checked on one GPU in a few minutes: the char_lm example trained
through a matrix of precision plugins and strategies, a resume from a mid-run checkpoint, and a table of
what each run reached.

    python scripts/gpu_check.py --out /tmp/gpu-check                 # all rows, 4 at a time
    python scripts/gpu_check.py --rows fp32 bf16 fsdp-bf16 --steps 100

Every row trains the same model on the same data (seed 0) for `--steps` steps and saves a checkpoint
half-way and at the end. Printed per row: exit status, the last logged training loss, the loss's distance
from the fp32 row's, wall time (rows run side by side on the one GPU, so it is a smoke figure, not a
benchmark: bench/compiled.py measures speed) and the GPU's peak memory as kiln logged it where it does.
The `resume` rows restart the RESUMED runs from their half-way checkpoints and compare their final weights with
the uninterrupted run's (max |difference|; cuBLAS and atomics in backward make bitwise equality on a GPU
a matter of luck, so the figure is reported, not asserted). DDP, FSDP and DeepSpeed run as one process on
NCCL: what a one-GPU machine can check of them is that their CUDA and NCCL paths run and train."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "char_lm", "config.yaml")
ROWS: dict[str, list[str]] = {
    "fp32": ["precision.name=fp32"],
    "tf32": ["precision.name=tf32"],
    "bf16": ["precision.name=bf16"],
    "fp16": ["precision.name=fp16"],
    # the example pins adamw_torch; kiln's default (HF's) is the fused AdamW, which takes GradScaler's
    # scale and inf flag into its kernel instead of being unscaled by the scaler
    "fp16-fused": ["precision.name=fp16", "optim.name=adamw_torch_fused"],
    "bf16-fused": ["precision.name=bf16", "optim.name=adamw_torch_fused"],
    # weight decay 0 (kiln's and HF's default): HF's two param groups are equal and step as one
    # (kiln/optim/merged_step.py), here under GradScaler's fused path and under FSDP2's DTensors
    "fp16-fused-merged": ["precision.name=fp16", "optim.name=adamw_torch_fused", "optim.weight_decay=0.0"],
    "fsdp-bf16-merged": ["precision.name=bf16", "strategy.name=fsdp", "optim.weight_decay=0.0"],
    "bf16-true": ["precision.name=bf16-true"],
    "bf16-compile": ["precision.name=bf16", "train.torch_compile=true"],
    "ddp-bf16": ["precision.name=bf16", "strategy.name=ddp"],
    "fsdp-bf16": ["precision.name=bf16", "strategy.name=fsdp"],
    "fsdp-bf16-compile": ["precision.name=bf16", "strategy.name=fsdp", "train.torch_compile=true"],
    "deepspeed2-bf16": ["precision.name=bf16", "strategy.name=deepspeed_stage_2"],
    "deepspeed3-bf16": ["precision.name=bf16", "strategy.name=deepspeed_stage_3"],
    "model_parallel-bf16": ["precision.name=bf16", "strategy.name=model_parallel"],
    # checkpoints written in the background: staged into pinned host memory, then a writer thread
    # (safetensors and torch files) or DCP's async_save (FSDP's sharded format)
    "bf16-async": ["precision.name=bf16", "save.async_save=true"],
    "fsdp-bf16-async": ["precision.name=bf16", "strategy.name=fsdp", "save.async_save=true"],
}
#: rows resumed from their half-way checkpoint, compared with the uninterrupted run (the `resume` rows)
RESUMED = ("bf16", "model_parallel-bf16", "bf16-async", "fsdp-bf16-async")


def common(steps: int, out: str) -> list[str]:
    return [
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "log.steps=10",
        "save.strategy=steps",
        f"save.steps={steps // 2}",
        "task.data_args.max_chars=400000",
        "task.data_args.sample_chars=40",
        "scheduler.warmup_steps=10",
    ]


def fit(name: str, overrides: list[str], out: str, timeout: float, fresh: bool = True) -> dict:
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
    cmd = [sys.executable, "-m", "kiln.cli", "fit", CONFIG, *overrides]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = -9, f"timed out after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
    with open(os.path.join(out, "console.log"), "w") as fh:
        fh.write(text)
    row = {"row": name, "rc": rc, "wall_s": round(time.perf_counter() - began, 1), **history(out)}
    if rc != 0:
        row["tail"] = text[-2500:]
    print(f"{name}: exit {rc}, loss {row.get('loss')}, {row['wall_s']} s", flush=True)  # a killed check still tells
    return row


def history(out: str) -> dict:
    """The last training loss and any GPU memory figure from the run's metrics.jsonl."""
    path = os.path.join(out, "runs", "metrics.jsonl")
    found: dict = {}
    if not os.path.exists(path):
        return found
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if "loss" in rec:
                found["loss"], found["step"] = rec["loss"], rec.get("step")
            for key, value in rec.items():
                if "mem" in key and "gpu" in key:
                    found[key] = value
    return found


def final_weights(out: str, steps: int) -> dict | None:
    """The last checkpoint's weights, or the run's final export where its checkpoints are DCP shards."""
    from safetensors.torch import load_file

    for path in (os.path.join(out, f"checkpoint-{steps}", "model.safetensors"), os.path.join(out, "model.safetensors")):
        if os.path.exists(path):
            return load_file(path)
    return None


def resume_row(name: str, base: str, steps: int, timeout: float) -> dict:
    """Row `name` again from its half-way checkpoint, compared with the uninterrupted run."""
    out = base + "-resume"
    shutil.rmtree(out, ignore_errors=True)
    finished = {
        f"checkpoint-{steps}",
        "runs",
        "console.log",
        "model.safetensors",
        "kiln_model.json",
        "trainer_state.json",
        "all_results.json",
        "train_results.json",
        "eval_results.json",
    }  # the end of the run, not the checkpoint's
    shutil.copytree(base, out, ignore=lambda folder, names: [n for n in names if folder == base and n in finished])
    row = fit(
        f"resume {name}",
        [*ROWS[name], f"resume_from_checkpoint={out}/checkpoint-{steps // 2}", *common(steps, out)],
        out,
        timeout,
        fresh=False,
    )
    a, b = final_weights(base, steps), final_weights(out, steps)
    if a is None or b is None:
        row["max_abs_diff"] = "missing checkpoint"
    else:
        row["max_abs_diff"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/gpu-check")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--rows", nargs="*", default=list(ROWS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    print(
        f"torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU'}",
        flush=True,
    )
    jobs = {name: os.path.join(args.out, name) for name in args.rows}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = {
            name: pool.submit(fit, name, [*ROWS[name], *common(args.steps, out)], out, args.timeout)
            for name, out in jobs.items()
        }
        rows = [futures[name].result() for name in jobs]
    for name in RESUMED:
        if name in jobs and rows[list(jobs).index(name)]["rc"] == 0:
            rows.append(resume_row(name, jobs[name], args.steps, args.timeout))
    ref = next((r.get("loss") for r in rows if r["row"] == "fp32"), None)
    print("\n| row | exit | step | loss | loss - fp32 | wall s | resume max abs diff |\n|---|---|---|---|---|---|---|")
    for r in rows:
        delta = f"{r['loss'] - ref:+.4f}" if ref is not None and "loss" in r else ""
        loss = f"{r['loss']:.4f}" if "loss" in r else ""
        print(
            f"| {r['row']} | {r['rc']} | {r.get('step', '')} | {loss} | {delta} | {r['wall_s']} | "
            f"{r.get('max_abs_diff', '')} |"
        )
    for r in rows:
        if r["rc"] != 0:
            print(f"\n--- {r['row']} (exit {r['rc']}) ---\n{r['tail']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
