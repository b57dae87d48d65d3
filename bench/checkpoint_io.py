"""Checkpoint save/load throughput vs. writing the same tensors with safetensors directly.

    python bench/checkpoint_io.py [--params 50] [--repeats 3] [--device cuda --batch 8192]

A model of `--params` million fp32 parameters takes one AdamW step (so the optimizer holds two more
tensors per parameter); then, interleaved `--repeats` times:

- kiln save: `trainer._save_checkpoint()`: weights (safetensors), optimizer, scheduler, RNG, trainer
  state, config, every file fsynced, the COMPLETE marker, the atomic rename;
- kiln load: `CheckpointManager.load()` into the same trainer (validation included);
- raw save: `safetensors.torch.save_file` of the same tensors (weights + optimizer moments) into one
  file, once without and once with an fsync (kiln always fsyncs: a checkpoint must survive a crash);
- checksums: the xxh3-64 digests kiln records in the marker (part of "kiln save"), timed alone over
  the same files, to show their share of the save (issue 34's budget: at most 5 %);
- async stall: with `save.async_save`, how long `trainer._save_checkpoint()` holds the training loop
  (staging the weights and optimizer state into the host buffers that the run's first async save
  allocated, the bytes copied on a thread of their own, and writing the small per-rank files); "async
  write" is the background write after it, timed to the save's completion (`checkpoints.wait()`);
- async loop stall: the same save inside a training loop that goes on stepping (forward, backward,
  AdamW step) until the write is complete: the time lost against as many steps without a save (the
  save call, the next optimizer step's wait for the staged copy, steps slowed by the writer's CPU use).
  Issue 56's goal: the stall at most 10 % of the synchronous save on a model of at least 100 MB; the
  steps' unslowed time is as many steps without a save, timed right after;
- async loop stall, light steps: the same with steps that need little CPU and mostly wait (a tiny
  model's forward and backward, then a 5 ms sleep standing in for the device): what a GPU run's
  training thread loses, where the steps need the GIL rather than the cores;
- async write GIL held: how long the background write keeps the training thread's Python from running,
  by a heartbeat thread (1 ms sleeps, real-time priority where allowed: see `gil_blocked`) that runs
  while the write runs alone;
- raw load: `safetensors.torch.load_file` of that file, the weights copied into the live parameters
  and the optimizer moments into fresh tensors (what a resuming process must end with: its model
  exists, its optimizer has no state yet, on the model's device; load_file alone only maps the file).

MB/s is checkpoint bytes / seconds (median). Files are read back from the page cache in both cases.

`--device cuda` keeps the model, its optimizer state and the steps on the GPU (`strategy.device`), with
`--batch` rows per step: the save then stages device memory into pinned host buffers, and each timed
step ends with a synchronize (what a loop that reads its loss each step waits for), so host timers time
the device's work.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
from omegaconf import read_write
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kiln.engine.checkpoint import files
from kiln.engine.checkpoint.integrity import file_digest
from kiln.engine.model.module import TrainingModule
from kiln.engine.trainer import Trainer


class Wide(TrainingModule):
    def __init__(self, params_m: float, width: int = 2048) -> None:
        super().__init__()
        layers = max(1, round(params_m * 1e6 / (width * width + width)))
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch):  # type: ignore[no-untyped-def]
        return self.body(batch["x"]).pow(2).mean()


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def raw_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    def whole(v: torch.Tensor) -> torch.Tensor:  # an FSDP shard of a one-process world is the whole tensor
        return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()

    tensors = {f"model.{k}": whole(v) for k, v in trainer.model.state_dict().items()}
    for i, state in trainer.optimizer.state_dict()["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.ndim:
                tensors[f"optim.{i}.{k}"] = whole(v)
    return tensors


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def no_checksums():  # type: ignore[no-untyped-def]
    """kiln's save with the checksum pass replaced by nothing: what the checksums add to a save."""
    saved = files.digest_file
    files.digest_file = lambda path: ""
    try:
        yield
    finally:
        files.digest_file = saved


REAL_TIME = True  # whether the heartbeat thread got real-time priority (root or CAP_SYS_NICE)


def gil_blocked(fn, period: float = 0.001) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Run `fn` while a heartbeat thread sleeps `period` in a loop; return the time the heartbeat lost
    beyond its sleeps (it waited for the GIL) and `fn`'s time. The heartbeat runs at real-time priority
    where allowed, so that the OS wakes it at once and only the GIL delays it; at ordinary priority, on a
    busy machine, the time it waits for a free core counts too (the figure is then an upper bound)."""
    done, lost = threading.Event(), [0.0]

    def beat() -> None:
        global REAL_TIME
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))  # this thread only
        except (PermissionError, AttributeError):
            REAL_TIME = False
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(period)
            now = time.perf_counter()
            if now - last > 2 * period:
                lost[0] += now - last - period
            last = now

    heart = threading.Thread(target=beat)
    heart.start()
    time.sleep(0.01)
    took = timed(fn)
    done.set()
    heart.join()
    return lost[0], took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50, help="model size in millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the model and its steps run (cpu, cuda)")
    parser.add_argument("--strategy", default="single", help="single, or fsdp (one process: DCP's async_save)")
    parser.add_argument("--batch", type=int, default=2, help="rows per timed training step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KILN_BENCH_DIR")) as tmp:
        out = os.path.join(tmp, "run")
        model = Wide(args.params)
        data = [{"x": torch.randn(2048)} for _ in range(2)]
        cfg = {
            "output_dir": out,
            "max_steps": 1,
            "per_device_train_batch_size": 2,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "log": {"history": [], "level": "error"},
            "strategy": {"name": args.strategy, "device": args.device},
        }
        trainer = Trainer(model, cfg, train_dataset=data)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit()
        tensors = raw_tensors(trainer)
        raw_path = os.path.join(tmp, "raw.safetensors")

        def raw_save(fsync: bool) -> None:
            save_file(tensors, raw_path)
            if fsync:
                with open(raw_path, "rb") as fh:
                    os.fsync(fh.fileno())

        def raw_load() -> dict[str, torch.Tensor]:
            moments = {}
            with torch.no_grad():
                for name, value in load_file(raw_path).items():
                    if name.startswith("model."):
                        tensors[name].copy_(value)
                    else:
                        moments[name] = value.to(tensors[name].device, copy=True)  # where the optimizer keeps it
            return moments

        times: dict[str, list[float]] = {
            k: []
            for k in (
                "kiln save",
                "kiln save, no checksums",
                "checksums",
                "kiln load",
                "async stall",
                "async write",
                "async loop stall",
                "async loop stall, light steps",
                "async write GIL held",
                "raw save",
                "raw save+fsync",
                "raw load",
            )
        }
        size = 0
        for _ in range(args.repeats):
            path = os.path.join(out, f"checkpoint-{trainer.state.global_step}")
            shutil.rmtree(path, ignore_errors=True)
            times["kiln save"].append(timed(trainer._save_checkpoint))
            size = folder_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            with no_checksums():
                times["kiln save, no checksums"].append(timed(trainer._save_checkpoint))
            times["checksums"].append(
                timed(
                    lambda path=path: [
                        file_digest(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
                    ]
                )
            )
            times["kiln load"].append(timed(lambda path=path: trainer.checkpoints.load(path)))
            times["raw save"].append(timed(lambda: raw_save(False)))
            times["raw save+fsync"].append(timed(lambda: raw_save(True)))
            times["raw load"].append(timed(lambda: raw_load()))
        # back to back, as in a run (a load in between gives the optimizer new tensors): the first async
        # save allocates the host buffers, the later ones copy into them
        with read_write(trainer.config):  # the run's config is read-only once loaded
            trainer.config.save.async_save = True
        for r in range(args.repeats + 1):
            shutil.rmtree(path, ignore_errors=True)
            stall, write = timed(trainer._save_checkpoint), timed(trainer.checkpoints.wait)
            if not r:
                first_stall = stall  # allocates (and pins, on a GPU) the host buffers
            if r:
                times["async stall"].append(stall)
                times["async write"].append(write)

        device = next(trainer.model.parameters()).device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        wrapped = trainer.run.wrapped  # the module the loop calls: FSDP gathers the weights in its forward

        def step() -> None:  # one optimizer step of the bench's model (the guard of the staged copy fires)
            wrapped({"x": torch.randn(args.batch, 2048, device=device)}, step="training_step").backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            sync()

        light = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))

        def light_step() -> None:
            """A GPU run's training thread: little CPU of its own (a tiny model's Python and dispatch),
            then a wait for the device (a 5 ms sleep). It needs the GIL, not the cores."""
            for _ in range(10):
                light(torch.randn(4, 16)).sum().backward()
            time.sleep(0.005)

        base = statistics.median(timed(step) for _ in range(5))
        for key, one_step in (("async loop stall", step), ("async loop stall, light steps", light_step)):
            for r in range(args.repeats + 1):
                # training goes on while the save is written: the loop's lost time is the save call, the
                # wait of the next optimizer step for the staged copy, and the steps slowed by the writer;
                # the same number of steps without a save, right after, is what they cost unslowed (the
                # machine's load drifts: a baseline taken once would drift with it)
                shutil.rmtree(path, ignore_errors=True)
                start, steps = time.perf_counter(), 0
                trainer._save_checkpoint()
                writer = trainer.checkpoints._background._thread
                while writer is not None and writer.is_alive():
                    one_step()
                    steps += 1
                elapsed = time.perf_counter() - start
                trainer.checkpoints.wait()
                unslowed = timed(lambda steps=steps, one_step=one_step: [one_step() for _ in range(steps)])
                if r:
                    times[key].append(elapsed - unslowed)
        for r in range(args.repeats + 1):
            # the GIL the background write holds: a real-time heartbeat thread counts the time it could
            # not run while only the writer (and the staged copy's thread) ran
            shutil.rmtree(path, ignore_errors=True)
            trainer._save_checkpoint()
            blocked, _ = gil_blocked(trainer.checkpoints.wait)
            if r:
                times["async write GIL held"].append(blocked)
        print(f"one training step without a save ({device}, {args.batch} rows): {base * 1000:.1f} ms")
        raw_size = os.path.getsize(raw_path)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n / 1e6:.1f} M fp32 params + AdamW moments; kiln checkpoint {size / 2**20:.0f} MiB, "
        f"raw safetensors {raw_size / 2**20:.0f} MiB; median of {args.repeats}"
    )
    for key in times:
        nbytes = raw_size if key.startswith("raw") else size
        rate = f"{nbytes / 2**20 / med[key]:8.0f} MiB/s" if med[key] > 0 else ""
        print(f"{key:>24}: {med[key] * 1000:8.1f} ms  {rate}")
    print(
        f"save ratio kiln / raw+fsync: {med['kiln save'] / med['raw save+fsync']:.2f}  "
        f"(kiln / raw without fsync: {med['kiln save'] / med['raw save']:.2f})"
    )
    print(f"load ratio kiln / raw:       {med['kiln load'] / med['raw load']:.2f}")
    print(
        f"async save: the save call stalls {100 * med['async stall'] / med['kiln save']:.1f} % of the synchronous save "
        f"({med['async stall'] * 1000:.1f} ms of {med['kiln save'] * 1000:.1f} ms); a training loop loses "
        f"{100 * med['async loop stall'] / med['kiln save']:.1f} % ({med['async loop stall'] * 1000:.1f} ms)"
    )
    print(f"the run's first async save call (allocating the host buffers): {first_stall * 1000:.1f} ms")
    added = med["kiln save"] - med["kiln save, no checksums"]
    print(
        f"a loop of light steps (a GPU run's thread: little CPU, 5 ms device waits) loses "
        f"{100 * med['async loop stall, light steps'] / med['kiln save']:.1f} % "
        f"({med['async loop stall, light steps'] * 1000:.1f} ms)"
    )
    print(
        f"the background write held the GIL {med['async write GIL held'] * 1000:.1f} ms of its "
        f"{med['async write'] * 1000:.1f} ms ({'real-time' if REAL_TIME else 'ordinary-priority, so CPU waits count too'} heartbeat)"
    )
    print(
        f"checksums: {100 * added / med['kiln save']:.1f} % of kiln save (timed alone: "
        f"{100 * med['checksums'] / med['kiln save']:.1f} %)"
    )


if __name__ == "__main__":
    main()
