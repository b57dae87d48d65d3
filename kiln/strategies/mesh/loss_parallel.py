"""`strategy.loss_parallel: true`: the output head's logits stay split by vocabulary (`Shard(-1)`) on
each TP rank and the cross entropy runs on the split inside torch's `loss_parallel()`, so no rank
materialises the whole (tokens x vocab) logits, nor their gradient; without it the head
(`colwise_gather_output`) all-gathers the full vocab on every TP rank.

It needs code that knows how to take a cross entropy over split logits, so kiln only keeps them
split where it knows the loss: the head is the Transformers model's output embedding, split
colwise by the plan, and the model's loss is HF's `ForCausalLMLoss` (`.float()`, the label shift,
`view(-1, V)`, `ignore_index`, the mean, or the sum over `num_items_in_batch`: each of those is a
DTensor op or one of `loss_parallel()`'s handlers). Anywhere else the head stays gathered and a log
line says why. At run time the logits stay split only for a training forward inside the strategy's
`micro_batch_context` (which wraps forward and backward in `loss_parallel()`) that passes `labels`,
i.e. one whose loss the model computes itself; evaluation, prediction, kiln's label smoothing
(which takes `labels` away from the model) and a TrainingModule computing its own loss from the
logits all get the whole logits, as before. The model's loss comes back as a DTensor replicated
over the TP ranks and is handed to the engine as the plain tensor it expects."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, MutableMapping
from typing import Any

from torch import nn

log = logging.getLogger(__name__)


def find_head(root: nn.Module, plan: dict[str, str], model: nn.Module | None) -> tuple[str | None, str]:
    """The name in `root` of the head of `model` (the Transformers model in `root`, or None) and "",
    where kiln can keep its logits split; else (None, why not)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    if head is None:
        return None, f"{type(root).__name__} holds no Transformers model with an output head (get_output_embeddings)"
    name = next(n for n, m in root.named_modules() if m is head)
    if plan.get(name) not in ("colwise_gather_output", "colwise_rep"):
        return None, (
            f"tp_plan does not split the head {name} colwise (tied input/output embeddings stay whole), "
            "so there are no split logits to keep"
        )
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss = getattr(model, "loss_function", None)
    if loss is not ForCausalLMLoss:
        return None, (
            f"{type(model).__name__}'s loss is {getattr(loss, '__name__', loss)!r}, not HF's ForCausalLMLoss, "
            "the loss kiln knows runs on vocab-split logits"
        )
    return name, ""


def head_style(sequence_parallel: bool) -> Any:
    """The head split colwise with its logits left split by vocabulary as a DTensor (the hook of
    `LossParallel` gathers them where the loss cannot take them split)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Shard(-1), use_local_output=False
    )


class LossParallel:
    """The hooks that decide, per forward, whether the head's logits stay split, and the context the
    strategy wraps around a training micro-batch."""

    def __init__(self, model: nn.Module, head: nn.Module) -> None:
        self.active = False  # inside context(): a training micro-batch's forward and backward
        self.own_loss = False  # the forward in flight was given labels: the model takes its own loss
        model.register_forward_pre_hook(self._model_in, with_kwargs=True)
        model.register_forward_hook(self._model_out)
        head.register_forward_hook(self._head_out)  # after ColwiseParallel's own output hook

    def _model_in(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.own_loss = kwargs.get("labels") is not None

    def _head_out(self, module: nn.Module, args: tuple, logits: Any) -> Any:
        if self.active and self.own_loss:
            return logits  # split by vocabulary: the model's ForCausalLMLoss runs on it under loss_parallel()
        from torch.distributed.tensor import Replicate

        return logits.redistribute(
            placements=[Replicate()] * logits.device_mesh.ndim
        ).to_local()  # colwise_gather_output

    def _model_out(self, module: nn.Module, args: tuple, output: Any) -> Any:
        from torch.distributed.tensor import DTensor

        self.own_loss = False
        # the loss is replicated over the TP ranks: each holds the whole value (backward: each its own vocab split)
        if isinstance(output, MutableMapping) and isinstance(output.get("loss"), DTensor):
            output["loss"] = output["loss"].to_local()  # ModelOutput keeps the attribute in step
        elif isinstance(output, tuple) and output and isinstance(output[0], DTensor):
            output = (output[0].to_local(), *output[1:])
        return output

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """torch's `loss_parallel()` around one micro-batch's forward and backward. Entered by hand so
        that an exception inside still switches its DTensor handlers off (torch's generator does not
        catch it, and the next evaluation would otherwise run them too)."""
        from torch.distributed.tensor.parallel import loss_parallel

        inner = loss_parallel()
        inner.__enter__()
        self.active = True
        try:
            yield
        finally:
            self.active = False
            inner.__exit__(None, None, None)
