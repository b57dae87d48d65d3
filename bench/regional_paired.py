"""Where regional compilation's steady-state cost goes (issue 54 item 4): bench/compiled.py's dec8 decoder compiled
whole and per block, with and without the code outside the blocks compiled too, in ONE process, their steps
interleaved.

    python bench/regional_paired.py                      # all variants, 40 interleaved rounds
    python bench/regional_paired.py --variants whole blocks --rounds 80

bench/compiled.py runs each variant in its own process, as a user would; on a shared machine the load drifts
between those processes, and a difference of a few per cent drowns in it. Here every variant is built and
compiled in one process (one thread, inductor compiling in-process), then each round runs one training step of
each variant in turn and reads the thread's CPU time around it: the load at any moment weighs on all variants
alike, so their ratio holds where the absolute figures do not. The step is a hand-written one (forward, backward,
AdamW, zero_grad) on the same batch, so kiln's loop is not in the figures: the compiled code is.

Variants (each a fresh copy of the same seed-0 model):
- whole: `torch.compile(model)`, one graph (kiln's `torch_compile: true`);
- blocks: each block's `forward` compiled in place (kiln's `torch_compile: {regions: blocks}`), the rest eager;
- eager: nothing compiled;
- leaves: blocks, plus every parameterised module outside them (embedding, final norm, head) compiled on its own,
  as accelerate's `compile_regions` does;
- tail: blocks, plus the embedding with the position add and the final norm, head and loss compiled as two more
  regions (written by hand: this model computes its loss inline in `forward`, where no generic rule reaches)."""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.compiled import DEC8, gpt_data  # noqa: E402
from bench.models import Decoder  # noqa: E402

VARIANTS = ("whole", "blocks", "eager", "leaves", "tail")


def build(variant: str, base: Decoder) -> tuple[Decoder, Callable[..., Any]]:
    """(the model whose parameters train, the callable a step runs)."""
    net = copy.deepcopy(base)
    if variant == "whole":
        return net, torch.compile(net)
    if variant == "eager":
        return net, net
    for block in net.blocks:
        block.forward = torch.compile(block.forward)
    if variant == "leaves":
        for module in (net.emb, net.norm, net.head):
            module.forward = torch.compile(module.forward)
    if variant != "tail":
        return net, net
    first = torch.compile(lambda ids: net.emb(ids) + net.pos)
    last = torch.compile(lambda h, labels: F.cross_entropy(net.head(net.norm(h)).flatten(0, 1), labels.flatten()))

    def forward(input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = first(input_ids)
        for block in net.blocks:
            h = block(h)
        return {"loss": last(h, labels)}

    return net, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=40, help="interleaved steps of each variant that are timed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # the compile's CPU time is this process's
    torch.manual_seed(0)
    base = Decoder(**DEC8)
    rows = gpt_data(n=8, shape=DEC8)
    ids, labels = torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])

    steps, first = {}, {}
    for variant in args.variants:
        net, model = build(variant, base)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)

        def step(model: Any = model, optimizer: torch.optim.Optimizer = optimizer) -> float:
            loss = model(ids, labels)["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().item()

        began = time.process_time()
        loss = step()  # compiles
        first[variant] = time.process_time() - began
        print(f"{variant}: first step {first[variant]:.2f} CPU s, loss {loss:.6f}", file=sys.stderr, flush=True)
        for _ in range(5):
            step()
        steps[variant] = step

    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(args.rounds):
        for variant, step in steps.items():
            began = time.thread_time()
            step()
            times[variant].append((time.thread_time() - began) * 1e3)
    ref = args.variants[0]
    print(f"{args.rounds} interleaved rounds; first step: this process's CPU time (the C++ compiler's not counted)\n")
    print(
        f"| variant | first step (CPU s) | CPU ms / step (median) | ratio of medians to {ref} | per-round ratio q25-q75 |"
    )
    print("|---|---|---|---|---|")
    for variant, ts in times.items():
        q1, _, q3 = statistics.quantiles([t / r for t, r in zip(ts, times[ref])], n=4)
        print(
            f"| {variant} | {first[variant]:.2f} | {statistics.median(ts):.1f} | "
            f"{statistics.median(ts) / statistics.median(times[ref]):.3f} | {q1:.3f}-{q3:.3f} |"
        )


if __name__ == "__main__":
    main()
