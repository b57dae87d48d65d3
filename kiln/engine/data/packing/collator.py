"""Packed rows (or plain examples) into one training batch.

Each item holds one or more pieces (`seq_lengths`, from `PackedRows`/`PackedStream`; a plain example is
one piece). The batch has:

- `input_ids`, `labels` and every other per-token key, as rows padded to the longest row of the batch, or
  all items concatenated into one row (`padding_free`);
- `position_ids` counting 0, 1, ... from every piece's first token (padding counts from 0 again);
- `labels` = the items' labels, or their input_ids when they have none and the model is a causal LM (as
  TRL and HF's flattening collator do), -100 on padding; for a model that shifts labels inside its loss
  (logits at t are scored against labels[t + 1]), also -100 at every piece's first token, so no piece's
  last token is trained to predict the next piece's first one. A piece's first label is never a target in
  the unpacked forward either, so the loss is the unpacked one, and so is `num_items_in_batch`;
- `cu_seq_lens_q`/`cu_seq_lens_k` (int32, the pieces' boundaries over the batch's tokens taken row after
  row, a row's padding as one more piece) and `max_length_q`/`max_length_k` (the longest piece):
  transformers' varlen flash-attention arguments, from which the model-side hook
  (kiln.engine.data.packing.attention) builds the block-diagonal mask for other implementations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.engine.data.packing.examples import ExampleReader
from kiln.utils.errors import ConfigError


class PackingCollator:
    def __init__(self, reader: ExampleReader, *, shifts_labels: bool, pad_id: int, padding_free: bool) -> None:
        self.reader, self.shifts_labels, self.pad_id, self.padding_free = reader, shifts_labels, pad_id, padding_free

    def _item(self, item: Any, index: int) -> tuple[dict[str, torch.Tensor], list[int]]:
        if isinstance(item, dict) and "seq_lengths" in item:  # a packed row
            lengths = [int(n) for n in item["seq_lengths"]]
            return {k: v for k, v in item.items() if k != "seq_lengths"}, lengths
        tensors = self.reader(item, f"example {index} of the batch")
        return tensors, [len(tensors["input_ids"])]

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        parts = [self._item(item, i) for i, item in enumerate(items) if len(_ids(item)) > 0]
        if not parts:
            raise ValueError("data.packing received a batch whose examples are all empty (no input_ids).")
        rows = [self._labelled(tensors, lengths) for tensors, lengths in parts]
        keys = list(rows[0])
        if any(list(row) != keys for row in rows):
            raise ConfigError(
                f"data.packing got items with different keys in one batch ({keys} and "
                f"{next(list(row) for row in rows if list(row) != keys)}); give every example the same keys."
            )
        pieces = [lengths for _, lengths in parts]
        if self.padding_free:
            rows = [{k: torch.cat([row[k] for row in rows]) for k in rows[0]}]
            pieces = [[n for lengths in pieces for n in lengths]]
        width = max(len(row["input_ids"]) for row in rows)
        pads = {"input_ids": self.pad_id, "labels": -100}
        batch: dict[str, Any] = {k: torch.stack([_pad(row[k], width, pads.get(k, 0)) for row in rows]) for k in rows[0]}
        with_padding = [lengths + ([width - sum(lengths)] if sum(lengths) < width else []) for lengths in pieces]
        batch["position_ids"] = torch.cat([torch.arange(n) for lengths in with_padding for n in lengths]).view(
            len(rows), width
        )
        cu = torch.tensor([0, *(n for lengths in with_padding for n in lengths)]).cumsum(0).to(torch.int32)
        longest = max(n for lengths in with_padding for n in lengths)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return batch

    def _labelled(self, tensors: dict[str, torch.Tensor], lengths: list[int]) -> dict[str, torch.Tensor]:
        if "labels" not in tensors and not self.shifts_labels:  # labels from input_ids: causal LMs only
            return tensors
        labels = tensors["labels"] if "labels" in tensors else tensors["input_ids"]
        if self.shifts_labels:
            labels = labels.clone()
            labels[_starts(lengths)] = -100
        return {**tensors, "labels": labels}


def _ids(item: Any) -> Sequence[Any]:
    return (
        item["input_ids"] if isinstance(item, dict) and "input_ids" in item else [None]
    )  # the reader refuses the rest


def _starts(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths[:-1]]).cumsum(0)


def _pad(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if len(tensor) == width:
        return tensor
    return torch.cat([tensor, tensor.new_full((width - len(tensor),), value)])
