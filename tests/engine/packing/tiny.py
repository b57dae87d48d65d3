"""Tiny Transformers models built from configs (no downloads), variable-length examples, and the unpacked
reference: each example as one right-padded row of an ordinary batch, with its attention mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

VOCAB = 64
CAUSAL = ("llama", "qwen2", "mistral", "gpt2")
MODELS = (*CAUSAL, "bert")


def shifts(model: Any) -> bool:
    """Whether the tiny model's loss predicts label t + 1 from token t (its family, not a rule under test)."""
    return type(model).__name__ != "BertForMaskedLM"


def config(name: str, impl: str = "sdpa") -> Any:
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "llama":
        cfg = T.LlamaConfig(**common, num_key_value_heads=2, max_position_embeddings=128)
    elif name == "qwen2":
        cfg = T.Qwen2Config(**common, num_key_value_heads=2, max_position_embeddings=128)
    elif name == "mistral":
        cfg = T.MistralConfig(**common, num_key_value_heads=2, max_position_embeddings=128)  # sliding_window 4096
    elif name == "gpt2":
        cfg = T.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    elif name == "bert":
        cfg = T.BertConfig(
            **common,
            max_position_embeddings=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            type_vocab_size=2,
        )
    elif name == "roberta":
        cfg = T.RobertaConfig(
            **common,
            max_position_embeddings=130,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=1,
        )
    else:
        raise ValueError(name)
    cfg._attn_implementation = impl
    return cfg


def model(name: str, impl: str = "sdpa", seed: int = 0) -> Any:
    import transformers as T

    torch.manual_seed(seed)
    if name == "bert":
        return T.BertForMaskedLM(config(name, impl))
    if name == "roberta":
        return T.RobertaForMaskedLM(config(name, impl))
    return T.AutoModelForCausalLM.from_config(config(name, impl))


def examples(name: str, n: int = 12, longest: int = 20, seed: int = 0) -> list[dict[str, list[int]]]:
    """Examples of 1..longest tokens. Causal LMs get labels equal to input_ids with a masked prompt (-100 on
    the first tokens of some); BERT gets masked-LM labels on some positions and two token types."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, longest + 1, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g)
        if name == "bert":
            labels = torch.where(torch.rand(length, generator=g) < 0.4, ids, torch.full_like(ids, -100))
            labels[0] = ids[0]  # a target at an example's first token: packing must keep it for unshifted losses
            types = (torch.arange(length) >= length // 2).long()
            out.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "token_type_ids": types.tolist()})
        else:
            labels = ids.clone()
            labels[: int(torch.randint(0, length, (1,), generator=g))] = -100
            out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def padded_batch(examples: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The unpacked reference batch: one example per row, right-padded, with its attention mask."""
    width = max(len(e["input_ids"]) for e in examples)
    pads = {"input_ids": pad_id, "labels": -100}
    batch = {
        k: torch.tensor([list(e[k]) + [pads.get(k, 0)] * (width - len(e[k])) for e in examples]) for k in examples[0]
    }
    batch["attention_mask"] = torch.tensor(
        [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples]
    )
    return batch


def token_losses(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Per-token cross-entropy of one example's logits (length, vocab) against its labels (0 where ignored):
    position t against labels[t + 1] when the model shifts (the last position has no target)."""
    if shift:
        logits, labels = logits[:-1], labels[1:]
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")


def padded_token_losses(model: Any, examples: Sequence[dict[str, Any]], shift: bool) -> list[torch.Tensor]:
    batch = padded_batch(examples)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return [
        token_losses(logits[i, : len(e["input_ids"])], batch["labels"][i, : len(e["input_ids"])], shift)
        for i, e in enumerate(examples)
    ]


def packed_token_losses(
    model: Any,
    batch: dict[str, Any],
    pieces: Sequence[Sequence[Any]],
    original: Sequence[dict],
    shift: bool,
    padding_free: bool,
) -> list[tuple[Any, torch.Tensor]]:
    """(piece, per-token losses) for every piece of the packed batch (rows of `pieces`, in batch order). The
    targets are the original examples' labels, so a label packing wrongly changed inside a piece shows."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    width = logits.shape[1]
    flat = logits.reshape(-1, logits.shape[-1])
    out, offset = [], 0
    for r, row in enumerate(pieces):
        if not padding_free:
            offset = r * width
        for piece in row:
            labels = torch.tensor(original[piece.example]["labels"][piece.start : piece.end])
            out.append((piece, token_losses(flat[offset : offset + piece.length], labels, shift)))
            offset += piece.length
    return out


def as_examples(original: Sequence[dict[str, Any]], pieces: Sequence[Any]) -> list[dict[str, Any]]:
    """The pieces as examples of their own (the unpacked reference of wrapped or split rows)."""
    return [{k: list(v)[p.start : p.end] for k, v in original[p.example].items()} for p in pieces]
