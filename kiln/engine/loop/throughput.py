"""Throughput as the fit logs it at every logging step: tokens/s, achieved TFLOP/s and MFU.

FLOPs of one micro-batch's forward and backward, as MFU counts them (PaLM's appendix B, torchtitan,
nanoGPT's estimate_mfu), counted on the host from the batch's shape, so no figure costs a device read:

- a model with its own `floating_point_ops(batch)` (a TrainingModule may define one) counts the batch;
- otherwise tokens x (6 N + 12 L d T): N the parameters a token multiplies (all but the embedding
  tables, counting an LM head tied to one), and for a Transformers model the attention term: L its
  `num_hidden_layers`, d its attention width (heads x head_dim), T the batch's sequence length: the
  scores and their weighted sum, with no discount for a causal mask (as the papers count). kiln cannot
  see another model's attention: it counts 6 N.

Tokens are the elements of the model's main input (`main_input_name`, `input_ids`). MFU is the achieved
FLOP/s over the device's peak for the run's number format (kiln.accelerators.peaks, or
`log.mfu_peak_tflops`), as a fraction; without a peak (the CPU) there is no MFU.

`total_flos` (HF's count, loop/flops.py) stays HF's rule: 6 x tokens x non-embedding parameters, no
attention term; these figures are for comparing with the hardware, not with HF's logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kiln.engine.loop.flops import _stock_floating_point_ops


class ModelFlops:
    """Tokens and FLOPs of one micro-batch (`count(batch)`), the model's rule decided once."""

    def __init__(self, model: Any) -> None:
        own = getattr(type(model), "floating_point_ops", None)
        self.own = model.floating_point_ops if own is not None and own is not _stock_floating_point_ops() else None
        config = getattr(model, "config", None)
        self.key = getattr(model, "main_input_name", "input_ids")
        self.per_token = 6.0 * matmul_parameters(model)
        layers, width = _attention_shape(config)
        self.attention = 12.0 * layers * width  # times T, per token

    def count(self, batch: Any) -> tuple[int, float]:
        main = batch.get(self.key) if isinstance(batch, Mapping) else None
        tokens = main.numel() if isinstance(main, torch.Tensor) else 0
        if self.own is not None:
            return tokens, float(self.own(batch))
        length = main.shape[-1] if isinstance(main, torch.Tensor) and main.dim() > 0 else 0
        return tokens, tokens * (self.per_token + self.attention * length)


def matmul_parameters(model: nn.Module) -> int:
    """N: the parameters a token multiplies, once each: all but the embedding tables (lookups), except an
    output projection tied to one (GPT-2's LM head is its token table: the projection multiplies)."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hf: Any = model  # an HF method, found by hasattr (nn.Module.__getattr__ would type it Tensor | Module)
    output = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if output is not None and getattr(output, "weight", None) is not None:
        lookups.discard(id(output.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def _attention_shape(config: Any) -> tuple[int, int]:
    """(layers, attention width) of a Transformers config; (0, 0) where it names neither."""
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or 0
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None) or 0
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None) or 0
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    return int(layers), int(heads * head_dim)


class Throughput:
    """Tokens and FLOPs counted per micro-batch on this rank; `figures` turns a logging window's counts
    (summed over the ranks by the caller's reduction) into the logged numbers."""

    def __init__(self, model: Any, peak_tflops: float | None) -> None:
        self.flops = ModelFlops(model)
        self.peak = peak_tflops
        self.tokens, self.flop_count = 0, 0.0  # this window, this rank

    def count(self, batch: Any) -> None:
        tokens, flops = self.flops.count(batch)
        self.tokens += tokens
        self.flop_count += flops

    def take(self) -> tuple[int, float]:
        """This window's (tokens, FLOPs) on this rank, and a new window."""
        counts = self.tokens, self.flop_count
        self.tokens, self.flop_count = 0, 0.0
        return counts

    def figures(
        self, tokens: float, flops: float, elapsed: float, ranks: int, prefix: str = "train_"
    ) -> dict[str, float]:
        """The logged figures for `tokens` and `flops` done by `ranks` processes in `elapsed` seconds: the
        job's tokens/s and TFLOP/s, the same per rank, and MFU (per device, so the job's equals a rank's
        average) when a peak is known."""
        elapsed = max(elapsed, 1e-9)
        out: dict[str, float] = {}
        if tokens:
            out[f"{prefix}tokens_per_second"] = tokens / elapsed
            out[f"{prefix}tokens_per_second_per_rank"] = tokens / elapsed / ranks
        if flops:
            tflops = flops / elapsed / 1e12
            out[f"{prefix}tflops"] = tflops
            out[f"{prefix}tflops_per_rank"] = tflops / ranks
            if self.peak:
                out["mfu"] = tflops / ranks / self.peak
        return out
