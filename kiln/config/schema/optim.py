"""`optim` and `scheduler`: the optimizer and the learning-rate schedule, named as HF names them."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

from kiln.config.schema.fields import opt


def hf_default_optimizer() -> str:
    """HF's default `optim` (transformers 5, `TrainingArguments.optim`): the fused AdamW kernel on torch >= 2.8,
    `adamw_torch` before. The version comes from torch when it is imported, else from the installed metadata
    (the config does not import torch)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        installed = str(torch.__version__)
    else:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("torch")
        except PackageNotFoundError:
            return "adamw_torch"
    try:
        major, minor = (int(part) for part in re.findall(r"\d+", installed)[:2])
    except ValueError:  # not two numbers
        return "adamw_torch"
    return "adamw_torch_fused" if (major, minor) >= (2, 8) else "adamw_torch"


@dataclass
class OptimConfig:
    """The optimizer (names as HF's `optim`)."""

    name: str = opt(
        hf_default_optimizer(),
        "Optimizer name, e.g. adamw_torch, adamw_torch_fused, sgd, adafactor. "
        "Default as HF's: adamw_torch_fused on torch >= 2.8 (adamw_torch before; on a device without "
        "fused kernels, such as XLA, it steps with adamw_torch's).",
    )
    lr: float = opt(5e-5, "Peak learning rate.")
    weight_decay: float = opt(
        0.0,
        "Decoupled weight decay; never applied to biases and norm weights. The optimizer has "
        "HF's two param groups whatever the decay (decayed weights, then biases and norm weights), "
        "so either Trainer resumes the other's checkpoints; while their settings are equal a step "
        "runs them as one group ([checkpoints](checkpoints.md#optimizer-param-groups)).",
    )
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.999, "Adam beta2.")
    adam_epsilon: float = opt(1e-8, "Adam epsilon.")
    optim_args: Optional[str] = opt(None, "Extra optimizer arguments, 'key=value,key=value'.")
    target_modules: Any = opt(
        None,
        "GaLore/APOLLO: module names (a list, or one regex) whose 2-D weights get the low-rank optimizer "
        "(optim_target_modules).",
    )


@dataclass
class SchedulerConfig:
    """The learning-rate schedule (names as HF's `lr_scheduler_type`)."""

    name: str = opt("linear", "Schedule name, e.g. linear, cosine, constant_with_warmup, warmup_stable_decay.")
    warmup_steps: int = opt(0, "Linear warmup steps; overrides warmup_ratio when > 0.")
    warmup_ratio: float = opt(0.0, "Fraction of total steps used for linear warmup.")
    kwargs: Dict[str, Any] = opt({}, "Extra schedule arguments (lr_scheduler_kwargs).")
