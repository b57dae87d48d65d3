"""`total_flos` as HF counts it, decided once per fit.

HF's rule (transformers 5 `Trainer.floating_point_ops`; in 4.x the same count through the model's own
`floating_point_ops`): 6 x the elements of the model's main input (`main_input_name`, "input_ids" for
language models) x its parameters that are not embedding tables (`num_parameters(exclude_embeddings=True)`),
per micro-batch, for a model that has `num_parameters` (Transformers models, and PEFT models around them);
0 for any other model. HF works the parameter count out again for every micro-batch (a walk over every
module and parameter); it cannot change during a fit, so kiln counts once.

A model with a `floating_point_ops` of its own (not Transformers' stock one) counts each batch itself, as
HF 4.x asks it to. For other models kiln counts 6 x every parameter per `input_ids` token, where HF would
log 0."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch


class FlopCount:
    """FLOPs of one micro-batch's forward and backward (`count(batch)`)."""

    def __init__(self, model: Any) -> None:
        own = getattr(type(model), "floating_point_ops", None)
        self.own = model.floating_point_ops if own is not None and own is not _stock_floating_point_ops() else None
        if hasattr(model, "num_parameters"):  # a Transformers model, or a PEFT model around one
            self.key = getattr(model, "main_input_name", "input_ids")
            self.per_element = 6.0 * model.num_parameters(exclude_embeddings=True)
        else:
            self.key, self.per_element = "input_ids", 6.0 * sum(p.numel() for p in model.parameters())

    def count(self, batch: Any) -> float:
        if self.own is not None:
            return float(self.own(batch))
        main = batch.get(self.key) if isinstance(batch, Mapping) else None
        return self.per_element * main.numel() if isinstance(main, torch.Tensor) else 0.0


def _stock_floating_point_ops() -> Any:
    """Transformers 4.x's `ModuleUtilsMixin.floating_point_ops` (the rule above), None where it has none."""
    modeling = sys.modules.get("transformers.modeling_utils")  # a Transformers model means it is imported
    mixin = getattr(modeling, "ModuleUtilsMixin", None)
    return getattr(mixin, "floating_point_ops", None)
