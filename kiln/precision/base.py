"""The Precision interface: everything numeric that differs between fp32, mixed and true-half
training. The loop calls these hooks in a fixed order and never asks which plugin it has:

    precision.check_device(device)                   # before anything runs; fails with one sentence
    module = precision.convert_module(module)        # before the strategy wraps the module
    style = precision.tensor_parallel_style(layer, style)  # tensor parallelism, per split layer
    module, optimizer = precision.connect(module, optimizer)   # once the optimizer exists (apex)
    precision.setup()                                # at train begin (TF32 flags); `teardown` at the end
    batch = precision.convert_input(batch)           # after batch_to_device (true half casts floats)
    with precision.forward_context(): loss = step(batch)
    precision.backward(loss)                         # scales the loss when a scaler is in use
    ... once per optimizer step:
    precision.unscale_gradients(optimizer)           # before clipping, so norms are true norms
    stepped = precision.optimizer_step(optimizer)    # False when the step was skipped (inf/nan grads)

Strategies that take precision over (FSDP's MixedPrecisionPolicy, DeepSpeed's config) read the
`compute_dtype` / `param_dtype` / `uses_grad_scaler` attributes instead of asking for a plugin type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kiln.utils.errors import PrecisionError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.tf32_flags import TF32State

#: `precision.full_eval` values -> the dtype the model is cast to for evaluation
EVAL_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

_NULL = contextlib.nullcontext()  # reentrant and stateless: one for every step


class Precision:
    """Default behaviour is plain fp32; plugins override only what they change.

    Subclasses that override `__init__`, `check_device`, `setup` or `teardown` call `super()` so that
    the shared parts (TF32 flags, `full_eval` checks, the device) keep working."""

    name: ClassVar[str] = "fp32"
    #: dtype of parameters after `convert_module` (None: unchanged)
    param_dtype: ClassVar[torch.dtype | None] = None
    #: dtype that matmuls run in (autocast dtype for mixed plugins, None for fp32). FSDP/DeepSpeed read it.
    compute_dtype: ClassVar[torch.dtype | None] = None
    #: whether the plugin scales the loss (fp16); a strategy that takes over must then scale too
    uses_grad_scaler: ClassVar[bool] = False
    #: FSDP2 shards the parameters and casts them (MixedPrecisionPolicy) in place of autocast: set on the
    #: substitute plugin the mesh strategy trains with, so a plugin can shape what FSDP all-gathers
    sharded_by_fsdp: ClassVar[bool] = False

    #: optimizer steps skipped because of inf/nan gradients (the loop may log it; saved in checkpoints)
    skipped_steps: int = 0
    _device: torch.device | None = None
    _tf32_saved: TF32State | None = None

    def __init__(self, config: DictConfig | None = None) -> None:
        self.config = config
        self.skipped_steps = 0

    # -- options ----------------------------------------------------------------------------
    def option(self, key: str, default: Any = None) -> Any:
        """`config.precision.<key>`, or `default` when the plugin was built without a config."""
        group = getattr(self.config, "precision", None) if self.config is not None else None
        value = getattr(group, key, None) if group is not None else None
        return default if value is None else value

    @property
    def tf32(self) -> bool | None:
        """`precision.tf32`: True/False set the TF32 flags for the run, None leaves them alone."""
        return self.option("tf32")

    @property
    def eval_dtype(self) -> torch.dtype | None:
        """dtype the model is cast to for evaluation outside training (`precision.full_eval`, HF's
        `fp16_full_eval` / `bf16_full_eval`), or None to evaluate with the training precision."""
        full_eval = self.option("full_eval")
        return EVAL_DTYPES[full_eval] if full_eval else None

    @property
    def device(self) -> torch.device:
        """The device passed to `check_device`; before that, the default one (CUDA if present)."""
        if self._device is not None:
            return self._device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    # -- set-up -----------------------------------------------------------------------------
    def check_device(self, device: torch.device) -> None:
        """Raise PrecisionError if this plugin cannot run on `device` (called before training).

        Also remembers `device`: mixed plugins autocast for its type."""
        self._device = torch.device(device)
        if self.tf32:
            from kiln.precision.tf32_flags import check_tf32_device

            check_tf32_device(self._device)
        if self.eval_dtype is not None:
            check_dtype_on_device(self.eval_dtype, self._device, f"precision.full_eval={self.option('full_eval')}")

    def setup(self) -> None:
        """Apply process-wide settings (TF32 flags); undone by `teardown`. Idempotent."""
        if self.tf32 is not None and self._tf32_saved is None:
            from kiln.precision.tf32_flags import set_tf32

            self._tf32_saved = set_tf32(self.tf32)

    def teardown(self) -> None:
        """Restore exactly what `setup` changed."""
        if self._tf32_saved is not None:
            from kiln.precision.tf32_flags import restore_tf32

            restore_tf32(self._tf32_saved)
            self._tf32_saved = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module itself (true half precision); mixed plugins leave it alone."""
        return module

    def tensor_parallel_style(self, layer: nn.Module, style: Any) -> Any:
        """The ParallelStyle tensor parallelism splits `layer` (a converted layer) with, given the one the
        plan chose; a plugin whose layers need their own (float8's) returns it, the others `style`."""
        return style

    def connect(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Called once both the module and its optimizer exist, before training (apex's
        `amp.initialize` needs both). Returns the pair to train with."""
        return module, optimizer

    # -- per step ---------------------------------------------------------------------------
    def convert_input(self, batch: Any) -> Any:
        """Cast a (device-placed) batch for the forward pass; true-half plugins cast float tensors."""
        return batch

    def forward_context(self) -> AbstractContextManager[Any]:
        """Context for the forward pass and loss computation (autocast for mixed precision)."""
        return _NULL

    def eval_context(self) -> AbstractContextManager[Any]:
        """Context for evaluation forward passes; the same as training unless a plugin differs."""
        return self.forward_context()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before clipping or inspecting them (a second call
        in the same step is a no-op)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; return False if the step was skipped (non-finite gradients)."""
        optimizer.step()
        return True

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only: checkpoints are loaded with `weights_only=True`."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state saved by `state_dict` (e.g. the GradScaler's scale and growth tracker)."""


def cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested batch to `dtype` (ints, bools stay as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        items = {k: cast_floating(v, dtype) for k, v in batch.items()}
        return items if type(batch) is dict else type(batch)(items)  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(cast_floating(v, dtype) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(cast_floating(v, dtype) for v in batch)
    return batch


def check_dtype_on_device(dtype: torch.dtype, device: torch.device, setting: str) -> None:
    """Reject a half dtype on a device that cannot compute in it, naming `setting` and the alternative
    (the device's accelerator knows what it supports).

    fp16 on a CPU without native fp16 kernels is the exception: torch still computes it (autocast,
    GradScaler('cpu') and half tensors all work there, through slower fallback kernels) and HF's
    Trainer accepts `fp16` / `fp16_full_eval` on such a CPU, so it runs, with one warning per process."""
    from kiln.accelerators import accelerator_for

    reason = accelerator_for(device).dtype_unsupported(dtype, torch.device(device))
    if reason is None:
        return
    if dtype is torch.float16 and torch.device(device).type == "cpu":
        _warn_slow_cpu_fp16(reason)
        return
    other = "bf16 instead (precision: bf16)" if dtype is torch.float16 else "fp16 instead (precision: fp16)"
    where = " or train on a CUDA GPU" if torch.device(device).type == "cpu" else ""
    place = _DEVICE_WORDS.get(torch.device(device).type, torch.device(device).type)
    raise PrecisionError(
        f"{setting} needs {_DTYPE_NAMES[dtype]} support on the {place}, but {reason}; use {other}{where}."
    )


#: whether the slow-fp16-on-CPU warning was given: a run checks fp16 for training and for full_eval
#: (and every Trainer of a hyperparameter search again), and one warning says all there is to say
_SLOW_FP16_WARNED = [False]


def _warn_slow_cpu_fp16(reason: str) -> None:
    if _SLOW_FP16_WARNED[0]:
        return
    _SLOW_FP16_WARNED[0] = True
    import warnings

    warnings.warn(
        f"fp16 runs on this CPU, but slowly: {reason}, so torch computes fp16 through fallback "
        "kernels, often slower than fp32; precision: bf16 (or fp32) is faster here.",
        UserWarning,
        stacklevel=3,
    )


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DEVICE_WORDS = {"cpu": "CPU", "cuda": "GPU", "mps": "Apple GPU (MPS)", "xla": "XLA device"}
