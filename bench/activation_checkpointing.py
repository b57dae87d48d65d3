"""Peak memory and step time of a small Llama-style transformer with no activation checkpointing, selective
checkpointing (torchtitan's per-op policy) and full checkpointing of every layer
(kiln/strategies/activation_checkpointing.py), on CPU with one thread.

Each variant runs in a fresh process and reports the growth of its peak resident memory (ru_maxrss) over one
forward and backward, measured after the model and batch exist, and the median of three timed steps after it.

    python bench/activation_checkpointing.py [--layers 8] [--width 256] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = {"none": None, "selective": {"mode": "selective"}, "full": {"mode": "full"}}


def child(variant: str, layers: int, width: int, tokens: int) -> dict[str, float]:
    import torch
    import transformers

    from kiln.strategies.activation_checkpointing import apply_activation_checkpointing

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
    ).train()
    if VARIANTS[variant]:
        apply_activation_checkpointing(model.model.layers, **VARIANTS[variant])
    ids = torch.randint(0, 1024, (1, tokens))

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=False)
        return time.perf_counter() - start

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**10  # KiB -> MiB
    return {"peak_mib": peak, "step_s": statistics.median(step() for _ in range(3))}


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
    rows = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant, *sizes], check=True, capture_output=True, text=True
        ).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    print(f"Llama-style, {args.layers} layers of width {args.width}, {args.tokens} tokens (CPU, one thread)\n")
    print("| activation checkpointing | peak memory over the step | step time |\n|---|---|---|")
    for variant, row in rows.items():
        print(f"| {variant} | {row['peak_mib']:.0f} MiB | {row['step_s']:.2f} s |")


if __name__ == "__main__":
    main()
