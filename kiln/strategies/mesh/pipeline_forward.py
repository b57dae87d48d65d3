"""Evaluation and prediction under the pipeline axis: the whole model's forward, run stage to stage.

No schedule is needed without a backward: every rank walks the stages in order, runs those it holds
(`StageForward`, the same code the training schedule runs), receives a stage's input from the rank
that ran the stage before and sends its output to the rank that runs the next. The last stage's logits
are broadcast over the pipeline, so that every rank returns what the full model would (loss with the
model's own `loss_function`, and logits): the evaluation loop, which every rank runs on the same
batches, then gathers, counts and reports as on one process."""

from __future__ import annotations

from typing import Any

import torch

from kiln.utils.errors import KilnError

#: the dtypes a stage's output may travel in, by their index in a message's header
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 6  # dtype index, dimension count, then up to 4 sizes


class ChainedForward:
    """The set-up model's forward during an evaluation (PipelineStrategy.eval_cast_context)."""

    def __init__(self, strategy: Any, model: Any) -> None:
        self.strategy, self.model = strategy, model

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **rest: Any,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        extra = sorted(k for k, v in rest.items() if isinstance(v, torch.Tensor))
        if extra:
            raise KilnError(
                "strategy.mesh.pp evaluates from input_ids, attention_mask and labels, and the batch holds "
                f"{', '.join(extra)} too; drop them from the collator's batches (remove_unused_columns)."
            )
        s = self.strategy
        owner, forwards, group = s._owner, iter(s.stage_forwards), s.pp_group
        me = s.pp_rank
        out: torch.Tensor | None = None
        for stage, rank in enumerate(owner):
            if rank != me:
                continue
            given: torch.Tensor | None
            if stage == 0:
                given = input_ids
            elif owner[stage - 1] == me:
                given = out
            else:
                given = _receive(owner[stage - 1], group, s.root_device)
            out = next(forwards)(given, attention_mask=attention_mask)
            if stage + 1 < len(owner) and owner[stage + 1] != me:
                _send(out, owner[stage + 1], group)
        logits = _broadcast(out if owner[-1] == me else None, owner[-1], group, s.root_device)
        loss = None
        if labels is not None:
            model = self.model
            loss = model.loss_function(
                logits=logits,
                labels=labels,
                vocab_size=model.config.vocab_size,
                num_items_in_batch=num_items_in_batch,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES or t.dim() > _HEADER - 2:
        raise KilnError(
            f"a pipeline stage's output is a {t.dtype} tensor of {t.dim()} dimensions, which kiln cannot send."
        )
    shape = [*t.shape, *[0] * (_HEADER - 2 - t.dim())]
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *shape], dtype=torch.long)


def _empty(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    code, dims, *shape = header.tolist()
    return torch.empty(shape[:dims], dtype=_DTYPES[code], device=device)


def _send(t: torch.Tensor, to: int, group: Any) -> None:
    import torch.distributed as dist

    dist.send(_header(t).to(t.device), group=group, group_dst=to)
    dist.send(t.contiguous(), group=group, group_dst=to)


def _receive(source: int, group: Any, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.recv(header, group=group, group_src=source)
    t = _empty(header.cpu(), device)
    dist.recv(t, group=group, group_src=source)
    return t


def _broadcast(t: torch.Tensor | None, source: int, group: Any, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    header = _header(t).to(device) if t is not None else torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, group=group, group_src=source)
    out = t.contiguous() if t is not None else _empty(header.cpu(), device)
    dist.broadcast(out, group=group, group_src=source)
    return out
