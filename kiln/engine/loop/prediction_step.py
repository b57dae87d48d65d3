"""The default `prediction_step` (HF's override point; `Trainer.prediction_step` calls this): one batch's
(loss, logits, labels), each possibly None, without gradients and in the precision plugin's eval context.

A TrainingModule runs its `validation_step` or `predict_step` (the Run's `eval_step`, set by the evaluation
loop); an HF-contract model runs `compute_loss` (the Trainer's, so an override is honoured) when the batch
has labels and returns its outputs as logits, or `model.generate` with `predict_with_generate`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kiln.engine.evaluation.nested import nested_detach

if TYPE_CHECKING:
    from kiln.engine.hooks import EvalHooks
    from kiln.engine.run import Run
    from kiln.precision.base import Precision


def prediction_step(
    hooks: EvalHooks,
    run: Run,
    precision: Precision,
    config: Any,
    model: Any,
    inputs: Any,
    loss_only: bool,
    ignore_keys: list[str] | None,
) -> tuple[Any, Any, Any]:
    """(loss, logits, labels) for one batch, each possibly None."""
    with torch.no_grad(), precision.eval_context():
        if run.facts.training_module:
            return _module_prediction_step(run, model, inputs, loss_only, ignore_keys)
        return _hf_prediction_step(hooks, run, config, model, inputs, loss_only, ignore_keys)


def _module_prediction_step(
    run: Run, model: Any, inputs: Any, loss_only: bool, ignore_keys: list[str] | None
) -> tuple[Any, Any, Any]:
    step = run.eval_step
    out = model(inputs, step=step)
    if isinstance(out, torch.Tensor):
        out = {"loss": out}
    if not isinstance(out, Mapping):
        raise TypeError(
            f"{step} must return a loss tensor or a dict with 'loss', 'logits' or 'predictions' "
            f"and 'labels'; got {type(out).__name__}."
        )
    loss = out.get("loss")
    loss = loss.detach() if isinstance(loss, torch.Tensor) else None
    if loss_only:
        return loss, None, None
    logits = out["logits"] if out.get("logits") is not None else out.get("predictions")
    if ignore_keys and isinstance(logits, Mapping):
        logits = {k: v for k, v in logits.items() if k not in ignore_keys}
    labels = out.get("labels")
    if labels is None:  # as for HF models: labels straight from the batch
        labels = _labels_from(run, inputs)
    return loss, nested_detach(logits), nested_detach(labels)


def _labels_from(run: Run, inputs: Any) -> Any:
    label_names = run.facts.label_names
    if not isinstance(inputs, Mapping) or not label_names or any(inputs.get(k) is None for k in label_names):
        return None
    labels = tuple(inputs[k].detach() for k in label_names)
    return labels[0] if len(labels) == 1 else labels


def _hf_prediction_step(
    hooks: EvalHooks,
    run: Run,
    config: Any,
    model: Any,
    inputs: Any,
    loss_only: bool,
    ignore_keys: list[str] | None,
) -> tuple[Any, Any, Any]:
    if ignore_keys is None:  # HF: the config's list, else the KV cache ("cache"; "past_key_values" before v5)
        model_config = getattr(run.model, "config", None)
        ignore_keys = (
            [] if model_config is None else list(getattr(model_config, "keys_to_ignore_at_inference", ["cache"]))
        )
    labels = _labels_from(run, inputs)
    loss = outputs = None
    if labels is not None:  # HF: the model divides its summed loss by this batch's label count
        count = run.facts.count_items(inputs) if run.facts.model_divides(inputs) else None
        loss, outputs = hooks.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=count)
        loss = loss.mean().detach()
    if loss_only:
        return loss, None, None
    if config.eval.predict_with_generate:  # no forward without labels: decoders need targets
        from kiln.engine.evaluation.generation import generate_predictions

        return (
            loss,
            generate_predictions(
                run.model,
                hooks.forward_inputs(inputs) if isinstance(inputs, Mapping) else inputs,
                set(run.facts.label_names),
                config.eval,
                run.gen_kwargs,
            ),
            labels,
        )
    if outputs is None:
        outputs = model(**hooks.forward_inputs(inputs))
    if isinstance(outputs, Mapping):  # dicts and Transformers ModelOutputs
        logits: Any = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"] and v is not None)
    elif isinstance(outputs, (tuple, list)):
        logits = tuple(outputs[1:] if labels is not None else outputs)
    else:
        logits = (outputs,)
    logits = nested_detach(logits)
    return loss, (logits[0] if len(logits) == 1 else logits), labels
