"""kiln and the hand-written loop interleaved inside one fit: every `--chunk` kiln steps, a callback runs as many
steps of the hand-written loop (bench/compiled.py's, on its own copy of the model, optimizer, schedule and
loader), so both share the process, the interpreter's caches and whatever else the machine is doing at that
moment. The ratio of each chunk pair is kiln's step time over the loop's; printed are its median and quartiles
over the chunks after the warm-up.

    python bench/interleaved.py                          # compiled tiny MLP: the figure in docs/benchmarks.md
    python bench/interleaved.py --grouped-step           # kiln stepping HF's two param groups one by one
    python bench/interleaved.py --contract               # and bench/contract_loop.py, HF's per-step contract by hand
    python bench/interleaved.py --eager --runs 3
    python bench/interleaved.py --device cuda --runs 3  # both bf16 autocast, CUDA synchronized at chunk ends only
    python bench/interleaved.py --model lm16 --chunk 100 --chunks 12   # issue 33's small transformer

On this 2-core VM the step time of the same loop moves by 10 % between processes and by a few per cent within
one (bench/compiled_paired.py pairs whole runs); pairing 200-step chunks resolves about half a per cent. kiln
runs bench/compare.py's recipe (AdamW without decay, linear schedule, clipping, a log event every 10 steps with
progress and csv + jsonl history); the loop reads its loss every 10 steps. A kiln step is timed from one
`on_step_end` to the next, so the data, the step, the callbacks and the log events are all in it."""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.compare import LOG_EVERY, LR, kiln_settings, linear  # noqa: E402
from bench.compiled import WORKLOADS, make  # noqa: E402

WARMUP = 100


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hand_written(
    net: torch.nn.Module, data: Any, batch: int, compile_model: bool, device: str
) -> Callable[[int], float]:
    """The loop of bench/compiled.py on `net`, runnable in pieces: `run(n)` takes n steps, returns their seconds."""
    cuda = device == "cuda"
    net.to(device)
    model = torch.compile(net) if compile_model else net
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear(10**7))  # linear like kiln's; the rate itself is not timed
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, pin_memory=cuda)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def batches() -> Iterator[Any]:
        while True:
            yield from loader

    stream = batches()

    def run(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        for step in range(1, n + 1):
            b = next(stream)
            if cuda:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with autocast:
                loss = model(**b)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % LOG_EVERY == 0:
                loss.item()
        sync(device)
        return time.perf_counter() - start

    return run


def one_run(args: argparse.Namespace) -> list[tuple[float, ...]]:
    """(kiln, loop) seconds a step, per chunk after the warm-up, from one fit; (kiln, loop, contract loop)
    with `--contract`."""
    from kiln import Callback, Trainer

    torch._dynamo.reset()
    net, data = make(args.model)
    batch = WORKLOADS[args.model].batch
    loop = hand_written(copy.deepcopy(net), data, batch, not args.eager, args.device)
    loop(WARMUP)  # the loop's compile and warm-up, before kiln's
    contract = None
    if args.contract:  # the floor of HF's per-step contract, written by hand (bench/contract_loop.py)
        from bench.contract_loop import contract_loop

        contract = contract_loop(copy.deepcopy(net), data, batch, not args.eager, LR, linear(10**7), LOG_EVERY)
        contract(WARMUP)
    pairs: list[tuple[float, ...]] = []

    class Interleave(Callback):
        last, spent, steps = 0.0, 0.0, 0

        def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step % args.chunk == 0 or state.global_step == WARMUP:  # kernels done (the loop syncs too)
                sync(args.device)
            now = time.perf_counter()
            if state.global_step > WARMUP:
                self.spent, self.steps = self.spent + now - self.last, self.steps + 1
                if state.global_step % args.chunk == 0:
                    timed = (self.spent / self.steps, loop(args.chunk) / args.chunk)
                    pairs.append(timed + ((contract(args.chunk) / args.chunk,) if contract else ()))
                    self.spent, self.steps = 0.0, 0
            self.last = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        config = {
            **kiln_settings(batch, WARMUP + args.chunk * args.chunks, out, device=args.device),
            "torch_compile": not args.eager,
        }
        if args.device == "cuda":
            config["precision"] = {"name": "bf16"}
        Trainer(net, config, train_dataset=data, callbacks=[Interleave()]).fit()
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=200, help="steps of each framework in turn")
    parser.add_argument("--chunks", type=int, default=30, help="chunk pairs a run")
    parser.add_argument("--runs", type=int, default=1, help="fits, one after the other in this process")
    parser.add_argument("--model", default="mlp", choices=("mlp", "lm16"), help="bench/compare.py's workload")
    parser.add_argument("--eager", action="store_true", help="no torch.compile in either")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: both run bf16 autocast")
    parser.add_argument(
        "--contract",
        action="store_true",
        help="also time bench/contract_loop.py (HF's per-step contract by hand) against the loop (CPU)",
    )
    parser.add_argument(
        "--grouped-step",
        action="store_true",
        help="kiln steps HF's two param groups one by one (kiln/optim/merged_step.py off)",
    )
    args = parser.parse_args()
    if args.contract and args.device != "cpu":
        parser.error("--contract runs on the CPU only (bench/contract_loop.py has no autocast or device copies)")
    torch.set_num_threads(1)
    if args.grouped_step:
        import kiln.engine.run

        kiln.engine.run.step_equal_groups_as_one = lambda optimizer: False  # type: ignore[assignment]
    for r in range(args.runs):
        pairs = one_run(args)
        ratios = [p[0] / p[1] for p in pairs]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        kiln_us = statistics.median(p[0] for p in pairs) * 1e6
        loop_us = statistics.median(p[1] for p in pairs) * 1e6
        what = (
            ("eager " if args.eager else "compiled ")
            + WORKLOADS[args.model].label
            + f" on {args.device}"
            + (", grouped step" if args.grouped_step else "")
        )
        print(
            f"run {r + 1}: {what}: "
            f"kiln {kiln_us:.1f} µs a step, loop {loop_us:.1f} µs; ratio median {statistics.median(ratios):.3f} "
            f"(quartiles {q1:.3f}–{q3:.3f}, {len(ratios)} chunk pairs of {args.chunk} steps)",
            flush=True,
        )
        if args.contract:
            floor = [p[2] / p[1] for p in pairs]
            c1, _, c3 = statistics.quantiles(floor, n=4)
            print(
                f"run {r + 1}: contract loop / loop: median {statistics.median(floor):.3f} (quartiles {c1:.3f}–{c3:.3f}); "
                f"kiln / contract loop: median {statistics.median(p[0] / p[2] for p in pairs):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
