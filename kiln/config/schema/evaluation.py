"""`eval`: evaluation during and after training, and generation for predictions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from kiln.config.schema.fields import opt


@dataclass
class EvalConfig:
    """Evaluation during and after training."""

    strategy: str = opt("no", "When to evaluate during training: no, steps or epoch.")
    steps: Optional[float] = opt(
        None, "Steps between evaluations (int, or a ratio < 1 of total steps); default logging steps."
    )
    delay: float = opt(0, "Epochs or steps to wait before the first evaluation.")
    on_start: bool = opt(False, "Evaluate once before training starts (sanity check).")
    accumulation_steps: Optional[int] = opt(None, "Move accumulated predictions to CPU every N eval steps.")
    prediction_loss_only: bool = opt(False, "Only compute the loss in evaluate/predict.")
    include_inputs_for_metrics: bool = opt(False, "Pass the inputs to compute_metrics (EvalPrediction.inputs).")
    do_concat_batches: bool = opt(True, "Concatenate per-batch predictions (False keeps a list per batch).")
    batch_eval_metrics: bool = opt(False, "Call compute_metrics per batch with compute_result.")
    padding_index: int = opt(-100, "Value used to pad predictions of different lengths.")
    compile: bool = opt(
        False,
        "Run the evaluation/prediction forward through torch.compile, with train.torch_compile_backend and "
        "torch_compile_mode (jit_mode_eval: HF's TorchScript tracing, which PyTorch deprecated).",
    )
    use_gather_object: bool = opt(
        False,
        "Gather outputs across ranks as Python objects (all_gather_object), for predictions that are not "
        "tensors (e.g. decoded strings); slower, opt-in (eval_use_gather_object).",
    )
    metric_for_best_model: Optional[str] = opt(None, "Metric that picks the best checkpoint (with or without 'eval_').")
    greater_is_better: Optional[bool] = opt(None, "Whether a larger metric is better (HF default by metric name).")
    load_best_model_at_end: bool = opt(False, "Restore the best checkpoint's weights when training ends.")
    predict_with_generate: bool = opt(False, "Use model.generate() for predictions (seq2seq).")
    generation_max_length: Optional[int] = opt(None, "max_length for generate().")
    generation_num_beams: Optional[int] = opt(None, "num_beams for generate().")
    generation_kwargs: Dict[str, Any] = opt({}, "Other generate() keyword arguments.")
