"""MXFP8 training through torchao (`precision: mxfp8`): the eligible `nn.Linear` layers become
`MXFP8Linear`, whose three matmuls (output, input gradient, weight gradient) cast both operands to
float8 e4m3 in blocks of 32 values along the reduced dimension, each block with its own power-of-two
scale (the OCP MX format; torchao's `mx_mm`). The rest of the model runs under bf16 autocast, as with
`precision: bf16`; weights, gradients and optimizer states stay fp32, so checkpoints hold ordinary weights.
Under autocast both operands are first cast to bf16, as autocast does for a linear layer (and as torchtitan's
bf16 FSDP parameters are), then to MXFP8.

- Recipes are torchao's (`precision.mxfp8.recipe`): `rceil` (scales rounded up, torchao's default) and
  `rceil_wgrad_with_hp` (the weight gradient's matmul kept in high precision).
- A layer is converted when it is a plain `nn.Linear`, both of its dimensions are multiples of 32 (the
  block) and no `precision.mxfp8.exclude` entry names it (`lm_head` by default). A training batch's token
  count (all dimensions of the layer's input but the last) must be a multiple of 32 too: the weight
  gradient is blocked along the tokens. A batch that is not is refused in one sentence.
- MXFP8 matmuls need an NVIDIA GPU of compute capability 10.0 (Blackwell). Elsewhere, the CPU included,
  `precision.mxfp8.emulate: true` must be set: torchao then computes the same rounding in high precision.
- torchao's own conversion (`quantize_` with `MXFP8TrainingOpConfig`) wraps the weight in a tensor subclass
  that checkpoints cannot hold and, in torchao 0.18, drops the layer's bias; kiln's layer calls torchao's
  matmul itself on a plain weight, and adds the bias.
- single and ddp only for now: FSDP2 and tensor parallelism refuse it (capabilities)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kiln.precision import PRECISIONS
from kiln.precision.amp import BF16MixedPrecision
from kiln.precision.float8 import eligible_linears
from kiln.utils.errors import PrecisionError

log = logging.getLogger(__name__)

#: values that share one scale: weights' dimensions and a batch's token count must be multiples of it
BLOCK = 32


def import_torchao_mx() -> Any:
    """torchao's MXFP8 matmul (a prototype API: a torchao without it is refused here, not at the first step),
    or one sentence naming the extra."""
    try:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    except ImportError:
        raise PrecisionError(
            "precision 'mxfp8' needs torchao 0.18's MXFP8 training matmul (torchao.prototype.moe_training), which "
            "this environment does not have; pip install 'kiln[float8]' (torchao 0.18)."
        ) from None
    return _to_mxfp8_then_scaled_mm


def mxfp8_unsupported(device: torch.device) -> str | None:
    """Why `device` cannot run MXFP8 matmuls, or None when it can."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"the {'AMD GPU' if device.type == 'cuda' else device.type.upper()} has no MXFP8 matmuls"
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 10:
        return None
    return f"this GPU's compute capability is {major}.{minor}, below the 10.0 (Blackwell) that MXFP8 matmuls need"


class MXFP8Linear(nn.Linear):
    """An `nn.Linear` whose matmuls run in MXFP8 (torchao's `mx_mm`) on its own fp32 weight."""

    kernel_preference: Any
    wgrad_with_hp: bool

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel_preference: Any, wgrad_with_hp: bool) -> MXFP8Linear:
        """The same layer (the same parameter objects) in MXFP8."""
        layer = cls.__new__(cls)
        layer.__dict__.update(linear.__dict__)
        layer.kernel_preference, layer.wgrad_with_hp = kernel_preference, wgrad_with_hp
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        tokens = input.numel() // input.shape[-1]
        if tokens % BLOCK and torch.is_grad_enabled() and self.weight.requires_grad:
            raise PrecisionError(
                f"precision 'mxfp8' computes the weight gradient in blocks of {BLOCK} tokens, and this batch has "
                f"{tokens} (all dimensions but the last of {tuple(input.shape)}); make the batch size times the "
                f"sequence length a multiple of {BLOCK} (pad the sequences, and set data.dataloader_drop_last for a "
                "short last batch)."
            )
        weight = self.weight
        if torch.is_autocast_enabled(input.device.type):  # autocast's rule for a linear layer: both operands
            dtype = torch.get_autocast_dtype(input.device.type)
            input, weight = input.to(dtype), weight.to(dtype)
        output = import_torchao_mx()(
            input,
            weight,
            kernel_preference=self.kernel_preference,
            scale_calculation_mode=ScaleCalculationMode.RCEIL,
            wgrad_with_hp=self.wgrad_with_hp,
        )
        return output if self.bias is None else output + self.bias.to(output.dtype)


@PRECISIONS.register("mxfp8")
class MXFP8Precision(BF16MixedPrecision):
    """`MXFP8Linear` layers under bf16 autocast. `converted` lists the layers `convert_module` swapped."""

    name = "mxfp8"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        settings = self.option("mxfp8", {})
        self.wgrad_with_hp: bool = settings.get("recipe", "rceil") == "rceil_wgrad_with_hp"
        self.exclude: list[str] = list(settings.get("exclude", ["lm_head"]))
        self.emulate: bool = bool(settings.get("emulate", False))
        if self.backend == "apex":
            raise PrecisionError(
                "precision 'mxfp8' cannot use half_precision_backend 'apex': its MXFP8 layers run under torch "
                "autocast; set half_precision_backend to 'auto'."
            )
        import_torchao_mx()
        self.converted: list[str] = []

    def check_device(self, device: torch.device) -> None:
        super().check_device(device)
        reason = None if self.emulate else mxfp8_unsupported(self.device)
        if reason is not None:
            raise PrecisionError(
                f"precision 'mxfp8' needs MXFP8 matmuls, but {reason}; set precision.mxfp8.emulate: true to emulate "
                "them (a real run's numbers, without its speed), or use precision: fp8 or bf16."
            )

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the eligible layers for `MXFP8Linear` in place (the same module is returned); they keep their
        parameters, so the optimizer, checkpoints and exports see the same fp32 tensors."""
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        kernels = KernelPreference.EMULATED if self.emulate else KernelPreference.AUTO
        names = [name for name in eligible_linears(module, self.exclude, BLOCK) if name]  # "": no parent to swap in
        for name in names:
            parent, _, leaf = name.rpartition(".")
            owner = module.get_submodule(parent)
            setattr(owner, leaf, MXFP8Linear.from_linear(getattr(owner, leaf), kernels, self.wgrad_with_hp))
        self.converted = sorted(names)
        log.info(
            "precision 'mxfp8'%s: %d linear layers in MXFP8, the rest in bf16.",
            " (emulated)" if self.emulate else "",
            len(names),
        )
        return module
