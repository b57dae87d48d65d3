"""Resume time at step 10 vs. step 100,000 of a large map-style dataset: must be about equal, because
kiln's sampler jumps to the saved batch instead of re-iterating the data.

    python bench/resume.py [--samples 2000000] [--far 100000] [--repeats 3]

A tiny model trains 10 steps and saves checkpoint-10. checkpoint-<far> is the same checkpoint with its
position moved to `far` batches into the epoch (trainer_state.json and the marker rewritten): training
100,000 real steps would only make the bench slow, and the position is all a resume looks at. Each
timing is a fresh Trainer's `fit(resume_from_checkpoint=...)` that resumes, runs one optimizer step
and stops (no save), i.e. everything between "restart" and "training again". For contrast, the cost
of reaching batch `far` by iterating the DataLoader (what re-iterating frameworks do) is measured on
a sample of batches and extrapolated.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kiln.engine.checkpoint.files import MARKER
from kiln.engine.model.module import TrainingModule
from kiln.engine.trainer import Trainer

BATCH = 8


class Synthetic(Dataset):
    """`n` samples computed from their index (no storage), like a large on-disk dataset."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, generator=g)
        return {"x": x, "y": x.sum()}


class Regressor(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch):  # type: ignore[no-untyped-def]
        return ((self.net(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()


def config(out: str, max_steps: int, save: bool) -> dict:
    return {
        "output_dir": out,
        "max_steps": max_steps,
        "per_device_train_batch_size": BATCH,
        "logging_steps": 10**9,
        "save_strategy": "steps" if save else "no",
        "save_steps": 10,
        "lr_scheduler_type": "constant",
        "report_to": "none",
        "disable_tqdm": True,
        "log": {"history": [], "level": "error"},
    }


def move_position(src: str, dst: str, step: int) -> None:
    """Copy checkpoint `src` to `dst` with its position set to `step` batches into epoch 0."""
    shutil.copytree(src, dst)
    state_path = os.path.join(dst, "trainer_state.json")
    state = json.loads(Path(state_path).read_text())
    state.update(global_step=step, batches_into_epoch=step, epoch_index=0, log_history=[])
    Path(state_path).write_text(json.dumps(state))
    marker = json.loads(Path(os.path.join(dst, MARKER)).read_text())
    marker["step"] = step
    marker["files"] = {f: os.path.getsize(os.path.join(dst, f)) for f in marker["files"]}
    Path(os.path.join(dst, MARKER)).write_text(json.dumps(marker))


def time_resume(dataset: Dataset, ckpt: str, step: int, out: str) -> float:
    trainer = Trainer(Regressor(), config(out, step + 1, save=False), train_dataset=dataset)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the final metrics line
        trainer.fit(resume_from_checkpoint=ckpt)
    elapsed = time.perf_counter() - start
    assert trainer.state.global_step == step + 1
    return elapsed


def iterate_cost(dataset: Dataset, batches: int, sample: int = 2000) -> float:
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    start = time.perf_counter()
    for _ in range(sample):
        next(it)
    return (time.perf_counter() - start) / sample * batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--far", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    assert args.far * BATCH < args.samples, "--far must stay inside the first epoch"
    torch.set_num_threads(1)
    dataset = Synthetic(args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):
            Trainer(Regressor(), config(os.path.join(tmp, "train"), 10, save=True), train_dataset=dataset).fit()
        near = os.path.join(tmp, "train", "checkpoint-10")
        far = os.path.join(tmp, f"checkpoint-{args.far}")
        move_position(near, far, args.far)
        time_resume(dataset, near, 10, os.path.join(tmp, "warm"))  # first-call costs (lazy imports)
        results: dict[int, list[float]] = {10: [], args.far: []}
        for r in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            results[10].append(time_resume(dataset, near, 10, os.path.join(tmp, f"a{r}")))
            results[args.far].append(time_resume(dataset, far, args.far, os.path.join(tmp, f"b{r}")))
    t_near, t_far = statistics.median(results[10]), statistics.median(results[args.far])
    print(f"dataset: {args.samples:,} samples, batch {BATCH}; median of {args.repeats} resumes (resume + 1 step)")
    print(f"resume at step {10:>9,}: {t_near * 1000:8.1f} ms")
    print(f"resume at step {args.far:>9,}: {t_far * 1000:8.1f} ms   (ratio {t_far / t_near:.2f})")
    print(f"re-iterating to step {args.far:,} instead would take about {iterate_cost(dataset, args.far):.1f} s")


if __name__ == "__main__":
    main()
