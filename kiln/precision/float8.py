"""float8 training through torchao (`precision: fp8`): the eligible `nn.Linear` layers become torchao's
`Float8Linear`, whose matmuls cast inputs, weights and gradients to float8 with dynamic scales; the rest
of the model runs under bf16 autocast, as with `precision: bf16`. Weights, gradients and optimizer states
stay fp32, so checkpoints hold ordinary high-precision weights.

- Recipes are torchao's by name (`precision.fp8.recipe`): `tensorwise` (one scale per tensor, the
  fastest), `rowwise` (a scale per row, more accurate) and `rowwise_with_gw_hp` (rowwise, with the weight
  gradient's matmul kept in high precision).
- A layer is converted when it is a plain `nn.Linear`, both of its dimensions are multiples of 16
  (float8 matmul kernels need that) and no `precision.fp8.exclude` entry names it. `lm_head` is excluded
  by default: the output projection is the layer most sensitive to float8's error.
- float8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) or an
  AMD MI300. Elsewhere, the CPU included, `precision.fp8.emulate: true` must be set: torchao then computes
  the same float8 rounding in high precision (the numbers of a real run, none of its speed), which is what
  the tests run on. Emulation is never chosen silently, since it is slower than bf16.
- Under FSDP (strategy fsdp, or model_parallel's dp axes) the module trains as torchtitan's does: FSDP's
  MixedPrecisionPolicy casts to bf16 in place of autocast, and with the tensorwise recipe each weight shard is
  cast to float8 before the all-gather (`precision.fp8.fsdp_float8_all_gather`, on by default there), so the
  weight is rounded once from fp32, as on one process, and the all-gather moves half of bf16's bytes.
- Under tensor parallelism (a mesh's tp axis) the layers are converted first and the tp plan then splits them,
  as torchtitan does: with the tensorwise recipe a float8 layer's colwise / rowwise split is torchao's
  `Float8ColwiseParallel` / `Float8RowwiseParallel` (`tensor_parallel_style`), whose input is cast to float8
  before it is all-gathered. The rowwise recipes keep torch's styles (torchao's cast its input per tensor).

torchao is an optional dependency (`pip install 'kiln[float8]'`), imported only when this plugin is built."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Any

import torch
from torch import nn

from kiln.precision import PRECISIONS
from kiln.precision.amp import BF16MixedPrecision
from kiln.utils.errors import PrecisionError

log = logging.getLogger(__name__)

#: float8 matmul kernels need both dimensions of the weight to be multiples of this
DIM_MULTIPLE = 16


def import_torchao_float8() -> Any:
    """torchao.float8, or one sentence naming the extra."""
    try:
        import torchao.float8
    except ImportError:
        raise PrecisionError(
            "precision 'fp8' needs torchao, which is not installed; pip install 'kiln[float8]' (or torchao)."
        ) from None
    return torchao.float8


def excluded(name: str, patterns: list[str]) -> bool:
    """Whether an `exclude` entry names the module at `name`: a run of whole name parts (`lm_head` names
    `lm_head` and `model.lm_head`, `layers.0` every module of the first layer), or a glob over the
    qualified name or a tail of it that starts at a part (`model.layers.*.mlp.*`, also where a wrapper
    puts the model under a prefix)."""
    parts = name.split(".")
    for pattern in patterns:
        if any(c in pattern for c in "*?[") and (
            fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)
        ):
            return True
        want = pattern.split(".")
        if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
            return True
    return False


def eligible_linears(module: nn.Module, exclude: list[str], multiple: int = DIM_MULTIPLE) -> list[str]:
    """Qualified names of the layers `precision: fp8` (or mxfp8, with its `multiple`) converts (see the module
    docstring). Only plain `nn.Linear`: its subclasses (quantized, LoRA-merged, already float8) compute
    something else."""
    return [
        name
        for name, child in module.named_modules()
        if type(child) is nn.Linear
        and child.in_features % multiple == 0
        and child.out_features % multiple == 0
        and not excluded(name, exclude)
    ]


def float8_unsupported(device: torch.device) -> str | None:
    """Why `device` cannot run float8 matmuls, or None when it can."""
    if device.type != "cuda":
        return f"the {device.type.upper()} has no float8 matmuls"
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return None if "gfx94" in arch else f"this AMD GPU ({arch}) has no float8 matmuls (MI300 and newer do)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 9):
        return None
    return f"this GPU's compute capability is {major}.{minor}, below the 8.9 (Ada, Hopper) that float8 matmuls need"


def cast_input_like_autocast(layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Cast a Float8Linear's input to the autocast dtype of its device, as autocast does for `F.linear`.
    torchao does this for CUDA autocast only (it reads the GPU's autocast dtype); under CPU autocast the
    input would stay fp32, and `rowwise_with_gw_hp`'s high-precision weight gradient would then multiply
    a bf16 gradient by an fp32 input and fail."""
    x = args[0]
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return (x.to(torch.get_autocast_dtype(x.device.type)), *args[1:])
    return None


@PRECISIONS.register("fp8", "float8")
class Float8Precision(BF16MixedPrecision):
    """float8 `Float8Linear` layers under bf16 autocast. `converted` lists the layers `convert_module`
    swapped, by qualified name."""

    name = "fp8"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        settings = self.option("fp8", {})
        self.recipe: str = settings.get("recipe", "tensorwise")
        self.exclude: list[str] = list(settings.get("exclude", ["lm_head"]))
        self.emulate: bool = bool(settings.get("emulate", False))
        all_gather = settings.get("fsdp_float8_all_gather")
        self.fsdp_float8_all_gather: bool = self.recipe == "tensorwise" if all_gather is None else bool(all_gather)
        self._scaled_for_fsdp: nn.Module | None = None  # the module whose float8 weight scales each step precomputes
        if self.backend == "apex":
            raise PrecisionError(
                "precision 'fp8' cannot use half_precision_backend 'apex': its float8 layers run under torch "
                "autocast; set half_precision_backend to 'auto'."
            )
        self.float8 = import_torchao_float8()
        self.converted: list[str] = []

    def check_device(self, device: torch.device) -> None:
        super().check_device(device)
        reason = None if self.emulate else float8_unsupported(self.device)
        if reason is not None:
            raise PrecisionError(
                f"precision 'fp8' needs float8 matmuls, but {reason}; set precision.fp8.emulate: true to emulate "
                "them (a real run's numbers, without its speed), or use precision: bf16."
            )

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the eligible layers for `Float8Linear` in place (the same module is returned); they keep
        their parameters, so the optimizer, checkpoints and exports see the same fp32 tensors."""
        all_gather = self.fsdp_float8_all_gather and self.sharded_by_fsdp
        config = dataclasses.replace(
            self.float8.Float8LinearConfig.from_recipe_name(self.recipe),
            emulate=self.emulate,
            enable_fsdp_float8_all_gather=all_gather,
        )
        names = set(eligible_linears(module, self.exclude))
        module = self.float8.convert_to_float8_training(
            module, module_filter_fn=lambda _, name: name in names, config=config
        )
        for name, child in module.named_modules():
            if name in names:
                child.register_forward_pre_hook(cast_input_like_autocast)
        self.converted = sorted(names)
        self._scaled_for_fsdp = module if all_gather and names else None
        log.info(
            "precision 'fp8' (%s%s): %d linear layers in float8%s, the rest in bf16.",
            self.recipe,
            ", emulated" if self.emulate else "",
            len(names),
            ", all-gathered by FSDP in float8" if all_gather else "",
        )
        return module

    def tensor_parallel_style(self, layer: nn.Module, style: Any) -> Any:
        """torchao's float8 counterpart of torch's colwise or rowwise `style` (its layouts kept) for a float8
        layer under the tensorwise recipe; `style` itself for any other layer or recipe."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if self.recipe != "tensorwise" or not isinstance(layer, self.float8.float8_linear.Float8Linear):
            return style
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        swap = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
        if swap is None:
            return style
        float8_style = object.__new__(swap)  # the same layouts: torchao only overrides how inputs/outputs are cast
        float8_style.__dict__.update(style.__dict__)
        return float8_style

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """After the step, the float8 all-gather's weight scales for the next forward, in one all-reduce
        of every weight's amax (torchtitan's `precompute_float8_dynamic_scale_for_fsdp`), instead of one
        all-reduce per weight inside the next all-gather. The scales are the same."""
        stepped = super().optimizer_step(optimizer)
        if stepped and self._scaled_for_fsdp is not None:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self._scaled_for_fsdp)
        return stepped
