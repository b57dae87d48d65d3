"""kiln, a hand-written loop, HF Trainer and Lightning side by side on the same work.

    python bench/compare.py --rounds 7            # the figures in docs/benchmarks.md
    python bench/compare.py --rounds 1 --steps 40 --transformer-steps 30 --lm16-steps 30 --augment-steps 30  # does it run
    python bench/compare.py --rounds 9 --models lm16 lm16-loader --frameworks hand-written kiln   # issue 33, item 1

Every framework trains the same model on the same data (the workloads of MODELS): batch 64 (8 sequences of
128 tokens for the transformer; issue 33's transformer, 2 layers of width 128, 16 sequences of 64 tokens,
handed over once as a dataset and once as a DataLoader; the tiny MLP behind a per-sample Python transform
with 0 and 2 loader workers, where the loader bounds the step), AdamW without weight decay (kiln's and HF's default;
torch's own default is 0.01) with torch's per-parameter kernels (OPTIM, pinned for every framework; kiln's and HF's
default, the fused kernel, is bench/optimizer_step.py's), a linear schedule, gradient clipping at 1.0, a log event
every 10 steps with the progress output on, and, where the framework has them, csv + jsonl history files (kiln: both; Lightning:
its CSVLogger; HF Trainer: none, it only prints). The hand-written loop reads its loss every 10 steps,
as logging would. HF Trainer and Lightning run only where installed (`pip install kiln[bench]`).

Each round runs every framework once, each in its own fresh process, in a new random order per round
(interleaved, so a slow moment of the machine hits all of them alike). Per run: the time per step over
the steps after a warm-up, and the start-up time, from process start to the end of the first step
(imports, building, the first step). Each round also times `import torch` and `import torch; import kiln`
(and `from kiln import Trainer`) in fresh interpreters. kiln's bytecode is written first, as an installed
package has it (see compile_sources). Printed: one markdown table of medians with their
spread (min-max over the rounds) and the ratio to the hand-written loop. Runs use one CPU thread."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))

from bench.harness import compile_sources, import_time, run_worker  # noqa: E402

WARMUP = 10
LOG_EVERY = 10
LR = 1e-3
OPTIM = "adamw_torch"  # the optimizer every framework runs (see the docstring), as kiln's and HF's `optim` name
FRAMEWORKS = ("hand-written", "kiln", "hf", "lightning")  # the default rows; HAND_HF_GROUPS on request
#: the hand-written loop again with the optimizer's param groups in HF's and kiln's layout (decayed weights, then biases
#: and norms: two groups even at weight decay 0), so the optimizer does the same work as kiln's; torch's AdamW runs
#: its set-up and (on CUDA, foreach) its kernels once per group
HAND_HF_GROUPS = "hand-written-hf-groups"
LABELS = {
    "hand-written": "hand-written loop",
    "kiln": "kiln",
    "hf": "HF Trainer",
    "lightning": "Lightning",
    HAND_HF_GROUPS: "hand-written, HF's 2 param groups",
}


class Workload(NamedTuple):
    """One group of rows: the model, its data, and how the data reaches the framework."""

    label: str
    batch: int
    steps: int  # steps per run (--steps / --transformer-steps override the first two)
    net: str  # "mlp", "transformer" (4 layers, width 256, 128 tokens) or "lm16" (issue 33: 2 layers, width 128, 64 tokens)
    as_loader: bool = False  # kiln is handed the hand-written loop's DataLoader instead of the dataset
    workers: int = 0  # dataloader_num_workers of every loader (kiln's config and the hand-written DataLoader)


MODELS = {
    "mlp": Workload("tiny MLP", 64, 2000, "mlp"),
    "transformer": Workload("small transformer", 8, 100, "transformer"),
    # issue 33, item 1: the same small transformer handed over as a dataset (kiln builds the loader) and as a DataLoader
    "lm16": Workload("transformer 2×128, Dataset", 16, 150, "lm16"),
    "lm16-loader": Workload("transformer 2×128, DataLoader", 16, 150, "lm16", as_loader=True),
    # issue 33, item 4: the tiny MLP behind a per-sample Python transform; the loader bounds the step
    "augment-w0": Workload("per-sample transform, 0 workers", 64, 400, "augment"),
    "augment-w2": Workload("per-sample transform, 2 workers", 64, 400, "augment", workers=2),
}


# -- one run (in its own process) ------------------------------------------------------------
class Clock:
    """Step marks: the end of the first step, the start of step WARMUP+1 and the end of the last. Beside
    the wall clock, the CPU time of the whole process (every thread; loader worker processes are not
    in it) over the same steps: on a shared 2-core VM the wall clock of a step swings by 10-15 % from
    run to run, while the CPU time a step costs moves far less, since waiting for the CPU is not in it."""

    def __init__(self, launched: float, steps: int) -> None:
        self.launched, self.steps = launched, steps
        self.first = self.start = self.end = self.process_start = self.process_end = 0.0

    def step_begin(self, done: int) -> None:
        if done == WARMUP:
            self.start, self.process_start = time.perf_counter(), time.process_time()

    def step_end(self, done: int) -> None:
        if done == 1:
            self.first = time.time()
        if done == self.steps:
            self.end, self.process_end = time.perf_counter(), time.process_time()

    def result(self) -> dict[str, float]:
        timed = self.steps - WARMUP
        return {
            "startup": self.first - self.launched,
            "per_step": (self.end - self.start) / timed,
            "cpu_per_step": (self.process_end - self.process_start) / timed,
        }


def build(model: str) -> tuple[Any, Any]:
    """The model and the dataset of workload `model`, the same for every framework (seed 0)."""
    import torch

    from bench.models import MLP, Augmented, SmallTransformer
    from bench.overhead import lm_data, mlp_data

    torch.manual_seed(0)
    net = MODELS[model].net
    if net == "mlp":
        return MLP(), mlp_data()
    if net == "augment":
        return MLP(), Augmented()
    if net == "lm16":
        return SmallTransformer(vocab=256, dim=128, layers=2, seq=64), lm_data(n=1024, seq=64)
    return SmallTransformer(), lm_data()


def hand_loader(model: str, data: Any, batch: int) -> Any:
    """The hand-written loop's loader (and the one kiln is handed in an `as_loader` workload)."""
    import torch

    return torch.utils.data.DataLoader(
        data, batch_size=batch, shuffle=True, drop_last=True, num_workers=MODELS[model].workers
    )


def linear(steps: int) -> Callable[[int], float]:
    return lambda s: max(0.0, (steps - s) / steps)


def run_hand_written(model: str, batch: int, steps: int, clock: Clock, out: str, hf_groups: bool = False) -> None:
    import torch

    net, data = build(model)
    params: Any = net.parameters()
    if hf_groups:  # HF's and kiln's two param groups (kiln imported only here: the loop's start-up stays torch's)
        from kiln.optim.optimizers import parameter_groups

        params = parameter_groups(net, 0.0)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)  # kiln's and HF's default (torch's is 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear(steps))
    loader = hand_loader(model, data, batch)
    net.train()
    step = 0
    while step < steps:
        for b in loader:
            clock.step_begin(step)
            loss = net(**b)["loss"]
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


def run_kiln(model: str, batch: int, steps: int, clock: Clock, out: str) -> None:
    from kiln import Trainer

    net, data = build(model)
    if MODELS[model].as_loader:
        data = hand_loader(model, data, batch)
    Trainer(net, kiln_config(model, batch, steps, out), train_dataset=data, callbacks=[kiln_marks(clock)]).fit()


def kiln_config(model: str, batch: int, steps: int, out: str) -> dict[str, Any]:
    return kiln_settings(batch, steps, out, workers=MODELS[model].workers)


def kiln_settings(batch: int, steps: int, out: str, workers: int = 0, device: str = "cpu") -> dict[str, Any]:
    """kiln's config for the shared recipe (bench/compiled.py adds its compile and precision keys)."""
    return {
        "output_dir": out,
        "max_steps": steps,
        "per_device_train_batch_size": batch,
        "learning_rate": LR,
        "lr_scheduler_type": "linear",
        "max_grad_norm": 1.0,
        "dataloader_drop_last": True,
        "dataloader_num_workers": workers,
        "optim": {"name": OPTIM},
        "log": {"steps": LOG_EVERY, "history": ["csv", "jsonl"], "disable_tqdm": False},
        "save": {"strategy": "no"},
        "strategy": {"device": device},
    }


def kiln_marks(clock: Clock) -> Any:
    """A kiln callback that hands the step marks to `clock`."""
    from kiln import Callback

    class Marks(Callback):
        def on_step_begin(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            clock.step_begin(state.global_step)

        def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            clock.step_end(state.global_step)

    return Marks()


def run_hf(model: str, batch: int, steps: int, clock: Clock, out: str) -> None:
    from transformers import Trainer, TrainingArguments

    net, data = build(model)
    args = TrainingArguments(**hf_arguments(batch, steps, out, workers=MODELS[model].workers))
    Trainer(model=net, args=args, train_dataset=data, callbacks=[hf_marks(clock)]).train()


def hf_arguments(batch: int, steps: int, out: str, workers: int = 0, **overrides: Any) -> dict[str, Any]:
    """TrainingArguments' keywords for the shared recipe; `overrides` replace or add keys."""
    return {
        "output_dir": out,
        "max_steps": steps,
        "per_device_train_batch_size": batch,
        "learning_rate": LR,
        "lr_scheduler_type": "linear",
        "max_grad_norm": 1.0,
        "logging_steps": LOG_EVERY,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "dataloader_drop_last": True,
        "disable_tqdm": False,
        "dataloader_num_workers": workers,
        "optim": OPTIM,
        **overrides,
    }


def hf_marks(clock: Clock) -> Any:
    """An HF TrainerCallback that hands the step marks to `clock`."""
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            clock.step_begin(state.global_step)

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            clock.step_end(state.global_step)

    return Marks()


def run_lightning(model: str, batch: int, steps: int, clock: Clock, out: str) -> None:
    import lightning as L

    net, data = build(model)
    trainer = L.Trainer(**lightning_arguments(steps, out, clock, accelerator="cpu"))
    trainer.fit(lightning_module(net, steps), hand_loader(model, data, batch))


def lightning_module(net: Any, steps: int) -> Any:
    """The LightningModule around `net`: its loss logged to the progress bar, AdamW and the linear schedule."""
    import lightning as L
    import torch

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.net(**batch)["loss"]
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)  # as kiln and HF
            sched = torch.optim.lr_scheduler.LambdaLR(opt, linear(steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def lightning_arguments(steps: int, out: str, clock: Clock, **overrides: Any) -> dict[str, Any]:
    """lightning.Trainer's keywords for the shared recipe, with a callback that hands the step marks to `clock`."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    class Marks(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):  # type: ignore[no-untyped-def]
            clock.step_begin(trainer.global_step)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            clock.step_end(trainer.global_step)

    return {
        "max_steps": steps,
        "devices": 1,
        "gradient_clip_val": 1.0,
        "log_every_n_steps": LOG_EVERY,
        "logger": CSVLogger(out),
        "enable_checkpointing": False,
        "enable_progress_bar": True,
        "enable_model_summary": False,
        "callbacks": [Marks()],
        "default_root_dir": out,
        **overrides,
    }


RUNNERS: dict[str, Callable[..., None]] = {
    "hand-written": run_hand_written,
    "kiln": run_kiln,
    "hf": run_hf,
    "lightning": run_lightning,
    HAND_HF_GROUPS: lambda *a: run_hand_written(*a, hf_groups=True),
}


def worker(framework: str, model: str, steps: int, launched: float) -> None:
    import torch

    torch.set_num_threads(1)
    clock = Clock(launched, steps)
    with tempfile.TemporaryDirectory() as out:
        RUNNERS[framework](model, MODELS[model][1], steps, clock, out)
    print("RESULT " + json.dumps(clock.result()), flush=True)


# -- the driver ------------------------------------------------------------------------------
def one_run(framework: str, model: str, steps: int) -> dict[str, float]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.path.dirname(BENCH),
        "TOKENIZERS_PARALLELISM": "false",
    }
    return run_worker(
        __file__, ["--worker", framework, "--models", model, "--steps", str(steps)], env, f"{framework} on {model}"
    )


def installed(framework: str) -> bool:
    import importlib.util

    package = {"hf": "transformers", "lightning": "lightning"}.get(framework)
    return package is None or importlib.util.find_spec(package) is not None


def runs_on(framework: str, model: str) -> bool:
    """HF Trainer takes datasets only: the rows where kiln is handed a DataLoader compare kiln, the
    hand-written loop and Lightning (which is always handed the hand-written loop's DataLoader)."""
    return not (framework == "hf" and MODELS[model].as_loader)


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    return f"{med:{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})" if len(values) > 1 else f"{med:{fmt}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000, help="MLP steps per run")
    parser.add_argument("--transformer-steps", type=int, default=100, help="small-transformer steps per run (>= 30)")
    parser.add_argument(
        "--lm16-steps", type=int, default=MODELS["lm16"].steps, help="issue 33's transformer steps per run"
    )
    parser.add_argument(
        "--augment-steps",
        type=int,
        default=MODELS["augment-w0"].steps,
        help="steps per run of the per-sample-transform rows",
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=list(RUNNERS))
    parser.add_argument("--worker", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.models[0], args.steps, args.launched)

    compile_sources()
    frameworks = [f for f in args.frameworks if installed(f)]
    if "hand-written" not in frameworks:
        frameworks.insert(0, "hand-written")
    skipped = [f for f in args.frameworks if f not in frameworks]
    per_net = {
        "mlp": args.steps,
        "transformer": args.transformer_steps,
        "lm16": args.lm16_steps,
        "augment": args.augment_steps,
    }
    steps = {m: max(WARMUP + 20, per_net[w.net]) for m, w in MODELS.items()}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    imports: dict[str, list[float]] = {"torch": [], "kiln": [], "trainer": []}
    rng = random.Random(0)
    for r in range(args.rounds):
        jobs = [(f, m) for m in args.models for f in frameworks if runs_on(f, m)]
        rng.shuffle(jobs)
        for framework, model in jobs:
            run = one_run(framework, model, steps[model])
            runs.setdefault((model, framework), []).append(run)
            print(
                f"  {LABELS[framework]} on {MODELS[model][0]}: {run['per_step'] * 1e3:.3f} ms/step, "
                f"start-up {run['startup']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        imports["torch"].append(import_time("import torch"))
        imports["kiln"].append(import_time("import torch; import kiln") - imports["torch"][-1])
        imports["trainer"].append(import_time("import torch; from kiln import Trainer") - imports["torch"][-1])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    print(f"{args.rounds} round(s); medians (min–max over rounds); one CPU thread; {WARMUP} warm-up steps not timed\n")
    print(
        "| model | framework | ms / step | ratio to hand-written | CPU ms / step | CPU-time ratio | "
        "start-up to first step (s) | start-up over hand-written (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        base = runs[(model, "hand-written")]
        for framework in (f for f in frameworks if runs_on(f, model)):
            these = runs[(model, framework)]
            ratios = [t["per_step"] / b["per_step"] for t, b in zip(these, base)]
            cpu_ratios = [t["cpu_per_step"] / b["cpu_per_step"] for t, b in zip(these, base)]
            extra = [t["startup"] - b["startup"] for t, b in zip(these, base)]
            print(
                f"| {MODELS[model][0]} ({steps[model]} steps) | {LABELS[framework]} | "
                f"{spread([t['per_step'] * 1e3 for t in these], '.3f')} | {spread(ratios, '.3f')} | "
                f"{spread([t['cpu_per_step'] * 1e3 for t in these], '.3f')} | {spread(cpu_ratios, '.3f')} | "
                f"{spread([t['startup'] for t in these], '.2f')} | {spread(extra, '+.2f')} |"
            )
    print(
        f"\n`import torch`: {spread(imports['torch'], '.3f')} s; `import kiln` adds {spread(imports['kiln'], '+.3f')} s; "
        f"`from kiln import Trainer` adds {spread(imports['trainer'], '+.3f')} s."
    )
    if skipped:
        print(f"\nNot installed, skipped: {', '.join(LABELS[f] for f in skipped)} (pip install kiln[bench]).")


if __name__ == "__main__":
    main()
