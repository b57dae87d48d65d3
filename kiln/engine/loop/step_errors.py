"""One sentence for a training step that failed because of what it was given or what it returned, in
place of the error from deep inside torch: a loss without a grad_fn (backward's "element 0 of tensors
does not require grad") and a batch of Python lists a step could not read (a data_collator that did not
stack its rows). Asked only after a step raised, so a step that works pays nothing for it; anything
else is left as it was raised."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from numbers import Number
from typing import Any

import torch

from kiln.engine.data.checks import describe
from kiln.utils.errors import KilnError

_NO_GRAD_FN = "does not require grad and does not have a grad_fn"


def _own(obj: Any, method: str) -> str | None:
    """`Class.method` when `obj`'s class (not kiln's) defines `method`, else None."""
    owner = next((c for c in type(obj).__mro__ if method in vars(c)), None)
    if owner is None or owner.__module__.startswith("kiln."):
        return None
    return f"{owner.__name__}.{method}"


def loss_maker(training_step: Callable[..., Any], model: Any, training_module: bool) -> str:
    """Who computed the loss: a Trainer subclass's training_step or compute_loss, else the
    TrainingModule's training_step, else the HF-contract model's forward."""
    trainer = getattr(training_step, "__self__", None)
    user = _own(trainer, "training_step") or _own(trainer, "compute_loss")
    if user is not None:
        return user
    return (
        f"{type(model).__name__}.training_step"
        if training_module
        else f"{type(model).__name__}.forward (read by Trainer.compute_loss)"
    )


def _unstacked(value: Any) -> bool:
    """A Python list of tensors or numbers: rows a collator should have stacked into one tensor."""
    return (
        isinstance(value, list)
        and bool(value)
        and isinstance(value[0], (torch.Tensor, Number))
        and not isinstance(value[0], bool)
    )


def explain(err: BaseException, batch: Any, maker: str, model: Any) -> KilnError | None:
    """The KilnError that says what went wrong in `err` (raised by a step on `batch`), or None."""
    if isinstance(err, RuntimeError) and _NO_GRAD_FN in str(err):
        frozen = not any(p.requires_grad for p in model.parameters())
        fix = (
            "unfreeze some parameters (none of the model's requires grad)"
            if frozen
            else "compute it from the model's outputs without .detach(), .item(), a new torch.tensor(...) or torch.no_grad()"
        )
        return KilnError(f"The loss from {maker} has no grad_fn, so backward() has nothing to differentiate: {fix}.")
    # the signs of a list where a dict or a tensor was expected: `batch["x"]` on a list, a list passed to an op
    if not isinstance(err, (TypeError, AttributeError)) or "list" not in str(err) and "tuple" not in str(err):
        return None
    reason = f"{type(err).__name__}: {err}"
    if isinstance(batch, (list, tuple)) and "indices must be integers or slices, not str" in str(err):
        return KilnError(
            f"{maker} reads the batch by key, but the batch is a {describe(batch)} ({reason}): have the "
            "data_collator return a dict of tensors such as {'input_ids': ..., 'labels': ...}, or read "
            "the batch by position in training_step."
        )
    lists = [k for k, v in batch.items() if _unstacked(v)] if isinstance(batch, Mapping) else []
    if lists:
        named = " and ".join(", ".join(map(repr, lists)).rsplit(", ", 1))
        return KilnError(
            f"{maker} failed on a batch whose {named} "
            f"{'is a Python list' if len(lists) == 1 else 'are Python lists'} of {len(batch[lists[0]])} rows, "
            f"not a tensor ({reason}): stack the rows in the data_collator (torch.stack or torch.tensor), "
            "or leave data_collator out for kiln's default collator, which does."
        )
    return None


def refuse_per_micro_batch_overrides(
    training_step: Callable[..., Any],
    run: Any,
    strategy: str,
    loss_source: str = "the model's forward (its 'loss' output)",
) -> None:
    """Refuse what acts per micro-batch under a strategy that runs the whole window as one schedule
    (`OwnsMicroBatchWindow`): it would silently never be called. `loss_source` is the strategy's, where
    the loss comes from instead."""
    trainer = getattr(training_step, "__self__", None)
    user = _own(trainer, "training_step") or _own(trainer, "compute_loss")
    if user is not None:
        raise KilnError(
            f"strategy {strategy!r} runs each accumulation window as one schedule, so {user}, which acts on "
            f"one micro-batch, would never be called: compute the loss in {loss_source}, and drop the override."
        )
    if run.backward_owner is not None:
        raise KilnError(
            f"{type(run.optimizer).__name__} updates the weights inside backward, but strategy {strategy!r} "
            "runs the backward passes in its own schedule: choose an optimizer that steps after backward "
            "(optim: adamw_torch)."
        )
