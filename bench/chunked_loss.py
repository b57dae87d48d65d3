"""Peak memory of one forward and backward of a tiny Llama with a 128k vocabulary (Llama 3's 128256), with
the plain loss (the whole [tokens x vocabulary] fp32 logits) and with `train.loss.chunked`
(kiln.engine.model.chunked_loss, inside the model's forward as the config puts it), at 4096 tokens on CPU. Goal (issue 54): chunked <= 0.5x plain.

Each variant runs in a fresh process and reports the growth of its peak resident memory (ru_maxrss) over
the step, measured after the model and batch exist; the step time is the median of three steps after one
that is not timed.

    python bench/chunked_loss.py [--tokens 4096] [--vocab 128256] [--chunk-size 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def child(variant: str, tokens: int, vocab: int, chunk_size: int) -> dict[str, float]:
    import torch
    import transformers

    from kiln.engine.model.chunked_loss import use_chunked_loss

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=vocab,
            max_position_embeddings=tokens,
        )
    )
    if variant == "chunked":  # what train.loss: {chunked: true} does: the loss inside the model's own forward
        use_chunked_loss(model, chunk_size)
    ids = torch.randint(0, vocab, (1, tokens))
    batch = {"input_ids": ids, "labels": ids}

    def step() -> float:
        start = time.perf_counter()
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=False)
        return time.perf_counter() - start

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20  # KiB -> GiB
    seconds = statistics.median(step() for _ in range(3))
    return {"peak_gib": peak, "step_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(child(args.variant, args.tokens, args.vocab, args.chunk_size)))
        return
    rows = {}
    for variant in ("plain", "chunked"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--tokens",
                str(args.tokens),
                "--vocab",
                str(args.vocab),
                "--chunk-size",
                str(args.chunk_size),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    print(f"tiny Llama, vocabulary {args.vocab}, {args.tokens} tokens, chunks of {args.chunk_size} (CPU, one thread)\n")
    print("| loss | peak memory over the step | step time |\n|---|---|---|")
    for variant, row in rows.items():
        print(f"| {variant} | {row['peak_gib']:.2f} GiB | {row['step_s']:.2f} s |")
    print(f"\nchunked / plain peak: {rows['chunked']['peak_gib'] / rows['plain']['peak_gib']:.2f}x")


if __name__ == "__main__":
    main()
