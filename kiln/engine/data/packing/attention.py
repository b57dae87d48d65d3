"""Attention that stays inside each packed example, given to the model with its inputs.

The packed batch carries the examples' boundaries as transformers' varlen flash-attention arguments
(`cu_seq_lens_q/k`, `max_length_q/k`). Flash-attention implementations take them as they are. For the
others, a forward pre-hook on the model turns them, on the batch's device, into the 4-D attention mask
transformers' mask builders return unchanged (`masking_utils`: a 4-D mask "was already prepared"):
block-diagonal over the pieces, lower-triangular too for causal models, as sdpa (bool), eager (additive
float) or flex_attention (a BlockMask) expect it.

Why not leave it to transformers: 5.x builds a packed mask from `position_ids` only in `create_causal_mask`,
only when the call passes `position_ids` (68 model families do not, e.g. OPT, and BERT as a decoder) and only
without a cache, while a model whose config has `use_cache: true` (most decoders) makes one in training
too; `create_bidirectional_mask` never does. Each of those would silently attend across examples."""

from __future__ import annotations

from typing import Any

import torch

from kiln.utils.errors import ConfigError

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def segments(cu_seq_lens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Which piece each token of a (batch, length) batch is in, from the pieces' boundaries over its tokens."""
    tokens = torch.arange(shape[0] * shape[1], device=cu_seq_lens.device)
    return (torch.searchsorted(cu_seq_lens[1:].to(tokens.dtype), tokens, right=True)).view(shape[0], shape[1])


def block_mask(seg: torch.Tensor, causal: bool) -> torch.Tensor:
    """(batch, 1, length, length) bool: True where query i may attend to key j."""
    allowed = seg[:, :, None] == seg[:, None, :]
    if causal:
        allowed = allowed & torch.ones(seg.shape[1], seg.shape[1], dtype=torch.bool, device=seg.device).tril()
    return allowed[:, None]


def flex_block_mask(seg: torch.Tensor, causal: bool) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def same_piece(b: Any, h: Any, q: Any, kv: Any) -> Any:
        allowed = seg[b, q] == seg[b, kv]
        return allowed & (q >= kv) if causal else allowed

    return create_block_mask(same_piece, seg.shape[0], None, seg.shape[1], seg.shape[1], device=seg.device)


class PackedAttention:
    """The pre-hook (see the module docstring); `window` is the sliding window of a model whose mask kiln
    builds, which a piece longer than it would overrun."""

    def __init__(self, kind: str, causal: bool, window: int | None, name: str) -> None:
        self.kind, self.causal, self.window, self.name = kind, causal, window, name

    def __call__(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:  # not a packed batch (evaluation, generation)
            return None
        if self.window is not None and int(kwargs.get("max_length_q", 0)) > self.window:
            raise ConfigError(
                f"{self.name} attends within a sliding window of {self.window} tokens, but a packed example "
                f"has {int(kwargs['max_length_q'])}; with data.packing, give examples of at most "
                f"{self.window} tokens or use a flash-attention implementation."
            )
        if self.kind == "varlen":
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        seg = segments(cu, ids.shape[:2])
        kwargs = {k: v for k, v in kwargs.items() if k not in VARLEN_KEYS}
        if self.kind == "flex":
            kwargs["attention_mask"] = flex_block_mask(seg, self.causal)
        else:
            mask = block_mask(seg, self.causal)
            kwargs["attention_mask"] = (
                mask
                if self.kind == "sdpa"
                else torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
            )
        return args, kwargs


def install(model: torch.nn.Module, hook: PackedAttention) -> None:
    """`hook` on `model`, replacing one installed by an earlier fit (its settings may differ)."""
    previous = getattr(model, "_kiln_packing_hook", None)
    if previous is not None:
        previous.remove()
    # a plain attribute: nn.Module.__setattr__ is typed for tensors and modules only
    model._kiln_packing_hook = model.register_forward_pre_hook(hook, with_kwargs=True)  # type: ignore[assignment]
