"""Real (non-pad) tokens per second of a small Llama-style transformer on a skewed length distribution, trained
by the Trainer with padded batches, with `group_by_length`, and with packing (`data.packing`), beside the same
padded batches in a hand-written loop; and each one's peak memory (issue 54 item 5).

Lengths are log-normal (median 64 tokens, sigma 1, cut to 8..512: most examples short, a long tail), as
fine-tuning sets are. Every variant trains one epoch over the same examples, each in a fresh process (one CPU
thread), and reports:

- real tokens/s: the examples' tokens (padding not counted) over the time from the first step's start to the
  last step's end (warm-up included, the same in each);
- its ratio to the hand-written padded loop, which trains the same padded batches with torch alone (AdamW,
  clipping at 1.0, as the Trainer does): how far kiln's padded batches are from that loop, and what packing and
  length grouping gain over it;
- real tokens per CPU second of the process (one thread: what the step computes, less sensitive to other
  processes on a loaded machine than the wall clock);
- the growth of the peak resident memory (ru_maxrss) over the epoch, after model and data exist.

Padded: batches of 8 examples in a random order, each padded to its batch's longest with an attention mask
(`data_collator`, what DataCollatorWithPadding does). group_by_length: the same batches of similar lengths
(HF's megabatches). Packing: `bfd` rows of 512 tokens, 2 per batch (about the tokens of 8 average examples
padded), positions restarting and attention kept inside each example (sdpa with kiln's block-diagonal mask).

    python bench/packing.py [--examples 512] [--width 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import each_in_a_fresh_process  # noqa: E402

VARIANTS = ("hand-written padded", "padded", "group_by_length", "packing")
BATCH, ROW, PACKED_BATCH = 8, 512, 2


def examples(n: int) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(n, generator=g) + math.log(64)).exp().round().clamp(8, ROW).long().tolist()
    return [{"input_ids": torch.randint(0, 1024, (length,), generator=g)} for length in lengths]


def pad(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Right-padding to the batch's longest example: ids 0, labels -100, attention mask 0."""
    import torch

    longest = max(len(e["input_ids"]) for e in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, e in enumerate(batch):
        ids[i, : len(e["input_ids"])] = e["input_ids"]
        mask[i, : len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def model(width: int, layers: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=width,
            num_attention_heads=width // 32,
            num_key_value_heads=width // 32,
            intermediate_size=4 * width,
            vocab_size=1024,
            max_position_embeddings=ROW,
            attn_implementation="sdpa",
        )
    )


def hand_written(net: Any, data: list[dict[str, Any]], marks: list[float], cpu: list[float]) -> None:
    import torch

    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, collate_fn=pad)
    net.train()
    marks.append(time.perf_counter())
    cpu.append(time.process_time())
    for batch in loader:
        net(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    marks.append(time.perf_counter())
    cpu.append(time.process_time())


def with_kiln(variant: str, net: Any, data: list[dict[str, Any]], marks: list[float], cpu: list[float]) -> None:
    from kiln import Callback, Trainer

    class Clock(Callback):
        def on_step_begin(self, *args: object, **kwargs: object) -> None:
            if not marks:
                marks.append(time.perf_counter())
                cpu.append(time.process_time())

        def on_train_end(self, *args: object, **kwargs: object) -> None:
            marks.append(time.perf_counter())  # after the last step (its end, and nothing saved or evaluated)
            cpu.append(time.process_time())

    config: dict[str, Any] = {
        "output_dir": "/tmp/kiln_bench_packing",
        "num_train_epochs": 1,
        "learning_rate": 1e-4,
        "per_device_train_batch_size": BATCH,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "strategy": "no"},
        "strategy": {"name": "single", "device": "cpu"},
    }
    collator = pad
    if variant == "group_by_length":
        config["data"] = {"group_by_length": True}
    elif variant == "packing":
        config["per_device_train_batch_size"] = PACKED_BATCH
        config["data"] = {"packing": {"strategy": "bfd", "max_length": ROW}}
        collator = None  # packing builds its own batches
    Trainer(net, config, train_dataset=data, data_collator=collator, callbacks=[Clock()]).fit()


def child(variant: str, n: int, width: int, layers: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    net, data = model(width, layers), examples(n)
    marks: list[float] = []
    cpu: list[float] = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (hand_written if variant == "hand-written padded" else lambda *a: with_kiln(variant, *a))(net, data, marks, cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tokens = sum(len(e["input_ids"]) for e in data)
    return {
        "tokens_per_s": tokens / (marks[-1] - marks[0]),
        "tokens_per_cpu_s": tokens / (cpu[-1] - cpu[0]),
        "peak_mib": (peak - before) / 2**10,  # KiB -> MiB
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = ["--examples", str(args.examples), "--width", str(args.width), "--layers", str(args.layers)]
    if args.variant:
        print(json.dumps(child(args.variant, args.examples, args.width, args.layers)))
        return
    rows = each_in_a_fresh_process(__file__, VARIANTS, sizes)
    base = rows["hand-written padded"]["tokens_per_s"]
    print(
        f"Llama-style, {args.layers} layers of width {args.width}, {args.examples} examples of log-normal lengths "
        "(median 64, 8..512 tokens), one epoch (CPU, one thread)\n"
    )
    cpu_base = rows["hand-written padded"]["tokens_per_cpu_s"]
    print(
        "| batches | real tokens/s | ratio to hand-written padded | real tokens per CPU second | its ratio "
        "| peak memory over the epoch |\n|---|---|---|---|---|---|"
    )
    for variant, row in rows.items():
        print(
            f"| {variant} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / base:.2f}x "
            f"| {row['tokens_per_cpu_s']:,.0f} | {row['tokens_per_cpu_s'] / cpu_base:.2f}x | {row['peak_mib']:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
