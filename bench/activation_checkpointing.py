"""Peak memory and step time of a small Llama-style transformer with no activation checkpointing, selective
checkpointing (torchtitan's per-op policy) and full checkpointing of every layer, trained by the Trainer
with the config's `activation_checkpointing: {mode: ...}` section, on CPU with one thread.

Each variant runs in a fresh process and reports the growth of its peak resident memory (ru_maxrss) over the
first optimizer step of the fit (forward, backward and the optimizer's state), measured after the model and
data exist, and the median time of the three steps after it.

    python bench/activation_checkpointing.py [--layers 8] [--width 256] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import each_in_a_fresh_process  # noqa: E402

VARIANTS = {"none": None, "selective": {"mode": "selective"}, "full": {"mode": "full"}}


def child(variant: str, layers: int, width: int, tokens: int) -> dict[str, float]:
    import torch
    import transformers

    from kiln import Callback, Trainer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=width,
            num_attention_heads=width // 64,
            num_key_value_heads=width // 64,
            intermediate_size=4 * width,
            vocab_size=1024,
            max_position_embeddings=tokens,
            attn_implementation="sdpa",
        )
    )
    ids = torch.randint(0, 1024, (tokens,))
    marks: list[tuple[float, int]] = []

    class Clock(Callback):
        def on_step_end(self, *args: object, **kwargs: object) -> None:
            marks.append((time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))

    config = {
        "output_dir": "/tmp/kiln_bench_ac",
        "max_steps": 4,
        "per_device_train_batch_size": 1,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "strategy": "no"},
        "strategy": {"name": "single", "device": "cpu"},
        **({"activation_checkpointing": VARIANTS[variant]} if VARIANTS[variant] else {}),
    }
    trainer = Trainer(model, config, train_dataset=[{"input_ids": ids, "labels": ids}] * 4, callbacks=[Clock()])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.fit()
    times = [later[0] - earlier[0] for earlier, later in zip(marks, marks[1:])]
    return {"peak_mib": (marks[0][1] - before) / 2**10, "step_s": statistics.median(times)}  # KiB -> MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = ["--layers", str(args.layers), "--width", str(args.width), "--tokens", str(args.tokens)]
    if args.variant:
        print(json.dumps(child(args.variant, args.layers, args.width, args.tokens)))
        return
    rows = each_in_a_fresh_process(__file__, VARIANTS, sizes)
    print(f"Llama-style, {args.layers} layers of width {args.width}, {args.tokens} tokens (CPU, one thread)\n")
    print("| activation checkpointing | peak memory over the step | step time |\n|---|---|---|")
    for variant, row in rows.items():
        print(f"| {variant} | {row['peak_mib']:.0f} MiB | {row['step_s']:.2f} s |")


if __name__ == "__main__":
    main()
