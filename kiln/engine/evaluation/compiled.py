"""`eval.compile` (HF's `jit_mode_eval`): the evaluation and prediction forward runs through
torch.compile.

HF traced the model with TorchScript for evaluation; PyTorch has deprecated TorchScript, and
torch.compile is its replacement, so kiln maps the flag to compiling the module that evaluation
calls (with `train.torch_compile_backend` / `torch_compile_mode`), and says so once. Training is
untouched: the compiled wrapper shares the module's parameters and is only used by the evaluation
loop. A module that `train.torch_compile` already compiled is used as it is."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class EvalCompiler:
    """Compiles the evaluation module once per set-up module and keeps the compiled wrapper."""

    def __init__(self) -> None:
        self._source: Any = None
        self._compiled: Any = None

    def __call__(self, model: Any, train_config: Any) -> Any:
        if hasattr(model, "_orig_mod"):  # train.torch_compile compiled it already
            return model
        if self._source is not model:
            import torch

            backend = train_config.torch_compile_backend or "inductor"
            self._compiled = torch.compile(model, backend=backend, mode=train_config.torch_compile_mode)
            self._source = model
            log.info(
                "jit_mode_eval (eval.compile): evaluation runs the model compiled with torch.compile "
                "(backend %r) instead of TorchScript tracing, which PyTorch has deprecated.",
                backend,
            )
        return self._compiled
