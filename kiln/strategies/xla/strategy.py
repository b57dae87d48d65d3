"""`strategy: xla`: the model on an XLA device (a TPU core, or CPU/GPU through PJRT) via torch_xla.

torch_xla records operations lazily and compiles each recorded graph once per shape, so:

- the graph is cut (`torch_xla.sync()`) after each micro-batch's backward and after each optimizer
  step (`GraphBoundaries`: `on_micro_batch_end` / `on_step_end`): every step then replays the same few cached graphs;
- nothing on the per-step path reads a value back to the host: the loss and the gradient norm stay
  device tensors, and the loop reads them only on logging steps (the test counts transfers);
- batches are uploaded by torch_xla's `MpDeviceLoader` in a background thread (xla_loader.py);
- static shapes (`Capabilities.static_shapes`): the Trainer drops each epoch's short last training batch
  and pads a short accumulation window's item counts, so no epoch end compiles a new graph (a
  DataLoader the user built keeps its short batch, reported once, as it costs one more compilation);
- with several replicas (a TPU host's cores, one process each), gradients are averaged with
  `xm.reduce_gradients` before clipping, like DDP, so the loop's loss weights are DDP's.
  Only one replica has been run (PJRT CPU has no cross-process collectives): see docs/xla.md.

The XLA RNG seed is saved in checkpoints by the XLA accelerator; weights and optimizer state are
written from CPU copies (xla_checkpoint_io.py). torch_xla is imported when the strategy is built.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.strategies import STRATEGIES
from kiln.strategies.base import StepResult, Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.interfaces import GraphBoundaries
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)

#: what the XLA strategies cannot train with, and why (shared with xla_fsdp)
XLA_REASONS = {
    "cpu": "it places the model on an XLA device (use strategy: single for the CPU)",
    "cuda": "it places the model on an XLA device (use strategy: single, ddp or fsdp on CUDA)",
    "mps": "it places the model on an XLA device (use strategy: mps on Apple GPUs)",
    "fp16": "XLA has no fp16 loss scaler; use precision: bf16",
    "fp16-true": "XLA trains in bf16, not fp16; use precision: bf16-true",
    "apex": "apex is CUDA-only; use precision: bf16",
    "tf32": "TF32 is a mode of NVIDIA GPUs; use precision: fp32",
    "fp8": "torchao's float8 layers run on CUDA, not XLA devices; use precision: bf16",
    "torch_compile": "XLA already compiles every step into one graph",
}
XLA_PRECISIONS = frozenset({"fp32", "bf16", "bf16-true"})


def import_torch_xla() -> Any:
    """torch_xla, or one sentence saying how to get it."""
    try:
        import torch_xla
    except ImportError:
        raise ConfigError(
            "The XLA strategies need torch_xla, which is not installed: pip install kiln[xla] "
            "(torch-xla pins its own torch; scripts/xla-env.sh builds such an environment)."
        ) from None
    return torch_xla


def sync() -> None:
    """Cut the lazily recorded graph here and run it (torch_xla.sync, formerly xm.mark_step)."""
    import torch_xla

    torch_xla.sync()


@STRATEGIES.register("xla")
class XLAStrategy(Strategy, GraphBoundaries):
    name = "xla"
    # auto_find_batch_size, full-eval casts and a user-built optimizer have not been run on XLA (an XLA
    # out-of-memory error is no torch.OutOfMemoryError, so the probe could not see it): refused
    capabilities = Capabilities(
        devices=frozenset({"xla"}),
        precisions=XLA_PRECISIONS,
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        torch_compile=False,
        static_shapes=True,
        reasons=XLA_REASONS,
    )
    checkpoint_formats = ("xla-full",)

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        super().__init__(config, precision)
        import_torch_xla()
        import torch_xla.runtime as xr

        requested = config.strategy.device if config is not None else None
        if requested is not None and torch.device(requested).type != "xla":
            raise ConfigError(
                f"strategy {self.name!r} runs on an XLA device, not on strategy.device={requested!r}; "
                "leave strategy.device unset, or use strategy: single for that device."
            )
        self._init_topology(xr)

    def _init_topology(self, xr: Any) -> None:
        """One process per replica (PJRT starts one per TPU chip/core; on CPU there is one)."""
        self.world_size = int(xr.world_size())
        self.global_rank = int(xr.global_ordinal())
        self.local_rank = int(xr.local_ordinal())
        self._device = self.accelerator_device()

    def accelerator_device(self) -> torch.device:
        import torch_xla

        return torch_xla.device()

    @property
    def root_device(self) -> torch.device:
        return self._device

    # -- set-up -----------------------------------------------------------------------------
    #: Gradients stay allocated between steps, zeroed in place (xla_gradients.py): every backward is
    #: then one graph, an epoch's short last window compiles nothing new, and a resumed run replays
    #: the uninterrupted run's graphs.
    persistent_gradients: bool = True

    def setup(
        self,
        module: nn.Module,
        optimizer_factory: Any | None = None,
        scheduler_factory: Any | None = None,
        *,
        max_steps: int | None = None,
    ) -> Any:
        setup = super().setup(module, optimizer_factory, scheduler_factory, max_steps=max_steps)
        if setup.optimizer is not None and self.persistent_gradients:
            from kiln.strategies.xla.gradients import PersistentGradients

            self._gradients = PersistentGradients()
            self._gradients.attach(setup.optimizer)
        return setup

    _gradients: Any = None  # the PersistentGradients of the run being trained

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move to the XLA device, keeping tied weights one Parameter: CPU and XLA tensors cannot share
        a shallow copy, so `Module.to` makes a new Parameter per name and a tie (an LM head sharing the
        embedding) would train as two weights."""
        ties: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            ties.setdefault(id(param), []).append(name)
        moved = module.to(self.root_device)
        for names in (group for group in ties.values() if len(group) > 1):
            shared = moved.get_parameter(names[0])
            for name in names[1:]:
                owner, _, leaf = name.rpartition(".")
                setattr(moved.get_submodule(owner), leaf, shared)
        return moved

    def settle_gradients(self) -> None:
        """Before an optimizer step: parameters no backward reached lose their zero gradient (once)."""
        if self._gradients is not None:
            self._gradients.settle()

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=not self.persistent_gradients)

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        from kiln.strategies.xla.loader import XLADeviceLoader, static_shape_warning

        if isinstance(dataloader, XLADeviceLoader) or not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader  # a loader the user built for the device, or plain batches (moved per batch)
        if not getattr(dataloader, "kiln_built", False):  # kiln's training loaders drop it (static_shapes)
            static_shape_warning(dataloader)
        return XLADeviceLoader(dataloader, self.root_device, prepare=self.prepare_batch())

    def prepare_batch(self) -> Callable[[Any], Any] | None:
        """What is done to each batch once it is on the device (SPMD marks its sharding); None: nothing."""
        return None

    # -- step -------------------------------------------------------------------------------
    def on_micro_batch_end(self) -> None:
        sync()

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        """Average the replicas' gradients (before clipping, so the norm is the global one), clip,
        step; all on the device: the norm stays a device tensor."""
        self.settle_gradients()
        self.precision.unscale_gradients(optimizer)
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)  # all-reduce, scaled by 1 / world size
        grad_norm = self.clip_gradients(model, optimizer, max_grad_norm) if max_grad_norm else None
        return StepResult(self.precision.optimizer_step(optimizer), grad_norm)

    def on_step_end(self) -> None:
        sync()

    # -- collectives (across replicas; identity with one) -----------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch_xla.core.xla_model as xm

        if op not in ("mean", "sum", "max", "min"):
            raise ValueError(f"reduce op must be one of mean, sum, max, min, got {op!r}.")
        t = torch.as_tensor(tensor)
        device = t.device
        t = t.to(self.root_device, dtype=t.dtype if t.is_floating_point() or op != "mean" else torch.float64)
        kind = {"mean": xm.REDUCE_SUM, "sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}[op]
        out = xm.all_reduce(kind, t, scale=1.0 / self.world_size if op == "mean" else 1.0)
        return out.to(device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        import torch_xla.core.xla_model as xm

        return xm.all_gather(tensor.to(self.root_device).unsqueeze(0), dim=0).to(tensor.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()])).flatten().tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        rows = self.all_gather(padded).cpu()
        return [pickle.loads(bytes(rows[i, :n].tolist())) for i, n in enumerate(sizes)]  # noqa: S301 - kiln's own ranks

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj if self.world_size == 1 else self.all_gather_object(obj)[src]

    def barrier(self, name: str | None = None) -> None:
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(name or "kiln")

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.xla.checkpoint_io import XLACheckpointIO

        return XLACheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        from kiln.strategies.xla.checkpoint_io import module_state_cpu

        return module_state_cpu(module)
