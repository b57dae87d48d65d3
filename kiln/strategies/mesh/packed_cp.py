"""Context parallelism over packed rows (`data.packing` with `mesh: {cp: N}`): attention with keys and
values gathered over the cp group and a mask that keeps every example to itself.

torch's ring attention, which cp runs otherwise (context_parallel.py), is causal over the whole row
and takes no mask, so the examples of a packed row would attend to each other. torch's masked cp path
(flex_attention over gathered keys and values) has no backward on CPU. So for packed rows kiln runs
the all-gather form of context parallelism (Llama 3's) through the model's own SDPA:

- `prepare` (from `context_parallel.prepare_batch`, before the split): the row's examples are read
  from its `position_ids` (an example starts where they stop counting on: the collator restarts them
  at 0 for every example and for a row's padding); rows are padded on the right to a length the
  split divides (a padding example of its own: labels -100, never attended to by a real token); the
  varlen arguments of the whole batch (`cu_seq_lens_q/k`, `max_length_q/k`), which no longer
  describe a chunk, are dropped; and `attention_mask` becomes this rank's (rows, 1, chunk, length)
  boolean mask: query i (at global position p_i) may attend to gathered key j (at p_j) when both are
  in the same example and p_j <= p_i. The gathered keys are the cp ranks' chunks in rank order.
- `gathered_attention` (from `micro_batch_context`, around forward and backward): the Transformers
  `sdpa` attention function gathers each layer's keys and values over the cp group (torch's
  `flex_cp_allgather`: an all-gather whose backward reduce-scatters the gradients) before SDPA; each
  rank's queries stay its own chunk. Exact: every query sees the same keys, values and mask as in
  the unsplit row."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

#: transformers' varlen flash-attention arguments, which describe the whole (unsplit) batch
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def documents(positions: torch.Tensor) -> torch.Tensor:
    """(rows, length) example index of every token: a new example wherever position_ids do not go on
    counting from the token before."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts.long().cumsum(1)


def pad_rows(batch: dict[str, Any], rows: int, length: int, multiple: int) -> tuple[dict[str, Any], int]:
    """`batch` with its (rows, length, ...) tensors padded on the right to a multiple of `multiple`:
    input_ids 0, labels -100, position_ids counting from 0 (one more example), others 0."""
    extra = -length % multiple
    if not extra:
        return batch, length
    fill = {"labels": -100, "shift_labels": -100}
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, length):
            if key == "position_ids":
                tail = torch.arange(extra, device=value.device, dtype=value.dtype).expand(rows, extra)
            else:
                tail = value.new_full((rows, extra, *value.shape[2:]), fill.get(key, 0))
            out[key] = torch.cat([value, tail], dim=1)
    return out, length + extra


def gathered_mask(docs: torch.Tensor, keep: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(rows, 1, len(keep), len(order)) bool: query at global position keep[i] may attend to the
    gathered key at global position order[j] (same example, not later)."""
    same = docs[:, keep][:, :, None] == docs[:, order][:, None, :]
    return (same & (keep[:, None] >= order[None, :]))[:, None]


@contextlib.contextmanager
def gathered_attention(cp_mesh: Any) -> Iterator[None]:
    """Transformers' `sdpa` attention with keys and values gathered over `cp_mesh` (sequence dim 2 of
    its (batch, heads, sequence, dim) inputs), for one micro-batch's forward and backward."""
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group = c10d._get_process_group_name(cp_mesh.get_group())

    def attend(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        key, value = flex_cp_allgather(key, value, 2, group)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = local.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = attend
    try:
        yield
    finally:
        if previous is None:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
        else:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
