"""The default `compute_loss` (HF's override point; `Trainer.compute_loss` calls this): the loss of one
micro-batch, as the model's call convention asks. A TrainingModule is called with the batch; an HF-contract
model with `**batch` (its forward's inputs only), `num_items_in_batch` when it divides a summed loss itself,
and HF's label smoothing when `label_smoothing_factor` is set."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kiln.engine.model.module import loss_from_output
from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from torch import nn

    from kiln.engine.model.facts import ModelFacts


def model_loss(
    facts: ModelFacts,
    user_model: nn.Module,
    model: nn.Module,
    inputs: Any,
    return_outputs: bool,
    num_items_in_batch: Any,
    forward_inputs: Callable[[Mapping[str, Any]], Mapping[str, Any]],
) -> Any:
    """The loss of one micro-batch (mean over its items) of `model` (the set-up module; `user_model` is the
    model as given, which label smoothing inspects), with the outputs too when `return_outputs`."""
    if facts.training_module:
        outputs = model(inputs)
    else:
        if not isinstance(inputs, Mapping):
            from kiln.engine.data.checks import describe

            raise KilnError(
                f"HF-contract models are called as model(**batch), so the batch must be a dict of tensors, "
                f"not a {describe(inputs)}: return dicts from the dataset or the data_collator."
            )
        inputs = forward_inputs(inputs)
        kwargs = (
            {"num_items_in_batch": num_items_in_batch}
            if num_items_in_batch is not None and facts.model_divides(inputs)
            else {}
        )
        if facts.label_smoothing and "labels" in inputs:
            from kiln.engine.model.label_smoothing import smoothed_loss

            labels = inputs["labels"]
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, **kwargs)
            loss = smoothed_loss(user_model, outputs, labels, facts.label_smoothing, kwargs.get("num_items_in_batch"))
            return (loss, outputs) if return_outputs else loss
        outputs = model(**inputs, **kwargs)
    loss = loss_from_output(outputs)
    return (loss, outputs) if return_outputs else loss
