"""What the pipeline's schedule runs on (pipeline.py's `run_window`): the accumulation window's
micro-batches stacked into one input (`stack_window`), and torch's schedule for windows of that shape
(`WindowSchedule`), built again when the shape changes (`schedule_class` picks its class)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.utils.errors import KilnError

#: the batch keys a stage reads; the rest would be dropped silently
_READ = ("input_ids", "labels", "attention_mask")


class WindowSchedule:
    """The schedule for windows of this many micro-batches of this shape: the stages' buffers are
    sized by the first micro-batch they see, so a new shape (the epoch's short last window, another
    padded length, a window with or without an attention mask) gets a new schedule, which measures the
    stages again. 1F1B needs as many micro-batches as stages; a shorter window (only the epoch's last
    can be) runs GPipe's order, whose gradients are the same."""

    def __init__(
        self, name: str, stages: list[Any], pp: int, loss: Callable[[torch.Tensor, torch.Tensor], Any]
    ) -> None:
        self.name, self.stages, self.pp, self.loss = name, stages, pp, loss
        for stage in stages:
            skip_own_rank_warmup(stage)
        self._schedule: Any = None
        self._key: tuple[Any, ...] | None = None

    def __call__(self, key: tuple[Any, ...]) -> Any:
        """`key`: (micro-batches, the stacked input's shape, whether the window has no mask)."""
        if key != self._key:
            for stage in self.stages:
                forget_shapes(stage)
            cls = schedule_class(self.name, key[0], self.pp)
            stages = self.stages if len(self.stages) > 1 else self.stages[0]
            self._schedule = cls(stages, n_microbatches=key[0], loss_fn=self.loss, scale_grads=False)
            self._key = key
        return self._schedule


def forget_shapes(stage: Any) -> None:
    """Make the next schedule measure `stage` again. A stage that keeps the shapes of its first input and
    output (`inputs_meta`, `_outputs_meta`: torch 2.11's PipelineStage; torch 2.13's measures each window
    itself) would refuse a window of another shape ("shape mismatch"), even under a new schedule."""
    if getattr(stage, "inputs_meta", None) is not None:
        stage.inputs_meta = None
        stage._outputs_meta = None


def skip_own_rank_warmup(stage: Any) -> None:
    """Leave out the send and receive a stage's warm-up would make with a neighbour stage on its own rank.
    Before its first step a schedule may send a dummy tensor from every stage to each neighbour stage
    (`_get_init_p2p_neighbors_ops`: torch 2.11's schedules do; torch 2.13's warm a PipelineStage up another
    way). zbv puts two neighbour stages on one rank, and gloo cannot send to its own rank ("Pair is
    not connected"); the stages on one rank hand their tensors over in memory, so no connection is missing
    without that pair."""
    warmup = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warmup is None:
        return
    own = stage.group_rank

    def to_other_ranks() -> list[Any]:
        return [op for op in warmup() if op.group_peer != own]

    stage._get_init_p2p_neighbors_ops = to_other_ranks


def schedule_class(name: str, microbatches: int, pp: int) -> type:
    """torch's schedule class for `name` and a window of `microbatches`. 1F1B needs as many
    micro-batches as stages, and the interleaved schedules a whole number of rounds (check_pipeline
    holds the full window to both); a shorter window (only an epoch's last can be) that misses them runs
    GPipe's order (on the same stages: LoopedBFS for several a rank), whose gradients are the same."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
    )

    if name == "1f1b":
        return Schedule1F1B if microbatches >= pp else ScheduleGPipe
    if name in ("interleaved_1f1b", "interleaved_zb") and microbatches % max(1, microbatches // pp):
        return ScheduleLoopedBFS
    return {
        "gpipe": ScheduleGPipe,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "interleaved_zb": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
    }[name]


def stack_window(window: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """The window's input_ids (and attention_mask, if any micro-batch has one) padded to one shape and
    stacked, and each micro-batch's labels padded alike; one sentence for a batch a stage cannot read."""
    first = window[0]
    if not isinstance(first, dict) or "input_ids" not in first or "labels" not in first:
        raise KilnError(
            "strategy.mesh.pp feeds the pipeline's stages from dict batches with input_ids and labels; "
            f"this batch is a {type(first).__name__}{' with keys ' + ', '.join(first) if isinstance(first, dict) else ''}"
            ": use a causal-LM collator (kiln's default, or DataCollatorForLanguageModeling)."
        )
    extra = sorted({k for b in window for k in b} - set(_READ))
    if extra:
        raise KilnError(
            f"strategy.mesh.pp reads only {', '.join(_READ)} of a batch, and it holds {', '.join(extra)} too; "
            "drop them from the collator's batches (remove_unused_columns), or train without pp."
        )
    rows = max(b["input_ids"].shape[0] for b in window)
    length = max(b["input_ids"].shape[1] for b in window)
    masked = any(b.get("attention_mask") is not None for b in window)
    ids, masks, labels = [], [], []
    for b in window:
        r, t = b["input_ids"].shape
        ids.append(_pad(b["input_ids"], rows, length, 0))
        labels.append(_pad(b["labels"], rows, length, -100))
        if masked:
            given = b.get("attention_mask")
            mask = _pad(given if given is not None else torch.ones_like(b["input_ids"]), rows, length, 0)
            mask[r:] = 1  # rows added for the shape attend normally (a row attending to nothing is NaN)
            masks.append(mask)
    return torch.cat(ids), torch.cat(masks) if masked else None, labels


def _pad(t: torch.Tensor, rows: int, length: int, value: int) -> torch.Tensor:
    if t.shape == (rows, length):
        return t
    out = t.new_full((rows, length), value)
    out[: t.shape[0], : t.shape[1]] = t
    return out
