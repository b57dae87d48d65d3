"""HF's `debug: underflow_overflow` (transformers' `DebugUnderflowOverflow`): find where inf/nan first
appears in the forward pass.

A forward hook on every module records, per call, the absolute min/max of the module's own
parameters, its inputs and its outputs (one "frame"). The last `max_frames_to_save` frames are
kept; the first time any of those tensors holds an inf or nan, the frames leading to it are printed
and training stops. `trace_batch_nums` prints every frame of the listed batches instead, and
`abort_after_batch_num` stops after that batch. A batch ends when the top module's forward returns.

Usable on its own like HF's class (`DebugUnderflowOverflow(model)` hooks the model at once), or as
a kiln callback: the Trainer adds one for `debug: underflow_overflow`, hooking the model when
training begins and unhooking it when training ends. The report format is HF's, line for line, so
guides written for HF's tool read the same."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kiln.engine.callbacks.base import Callback
from kiln.utils.errors import KilnError

_PREFIX = " " * 17


class OverflowDetected(KilnError):
    """A forward pass produced (or was given) an inf or nan; the frames before it have been printed."""


def abs_min_max(var: torch.Tensor, ctx: str) -> str:
    abs_var = var.abs()
    return f"{abs_var.min():8.2e} {abs_var.max():8.2e} {ctx}"


def has_overflow(var: torch.Tensor, ctx: str, print_fn: Callable[[str], None] = print) -> bool:
    """True when `var` holds a nan or an inf (each reported on its own line, as HF does)."""
    detected = False
    if torch.isnan(var).any().item():
        detected = True
        print_fn(f"{ctx} has nans")
    if torch.isinf(var).any().item():
        detected = True
        print_fn(f"{ctx} has infs")
    return detected


class DebugUnderflowOverflow(Callback):
    """Watch every module's forward for inf/nan; on the first one, print the last frames and stop.

    `model` given: hook it now (HF's usage). Without it, the Trainer's model is hooked on
    `on_train_begin`."""

    def __init__(
        self,
        model: nn.Module | None = None,
        max_frames_to_save: int = 21,
        trace_batch_nums: Iterable[int] = (),
        abort_after_batch_num: int | None = None,
        print_fn: Callable[[str], None] = print,
    ) -> None:
        self.max_frames_to_save = max_frames_to_save
        self.trace_batch_nums = list(trace_batch_nums)
        self.abort_after_batch_num = abort_after_batch_num
        self.print_fn = print_fn
        self.model: nn.Module | None = None
        self._handles: list[Any] = []
        if model is not None:
            self.attach(model)

    # -- hooking ------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Hook every module of `model` and start counting batches from 0."""
        self.detach()
        self.model = model
        self.frames: collections.deque[str] = collections.deque([], self.max_frames_to_save)
        self.frame: list[str] = []
        self.batch_number = 0
        self.total_calls = 0
        self.detected_overflow = False
        # shared modules are reported under their first name
        self.module_names = {m: name for name, m in model.named_modules()}
        self._handles = [m.register_forward_hook(self._forward_hook) for m in model.modules()]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.model is None and kw.get("model") is not None:
            self.attach(kw["model"])

    def on_train_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.detach()

    # -- frames -------------------------------------------------------------------------------
    def _line(self, line: str) -> None:
        self.frame.append(line)

    def _save_frame(self) -> None:
        self.frames.append("\n".join(self.frame))
        self.frame = []

    def _analyse(self, var: Any, ctx: str) -> None:
        if torch.is_tensor(var):
            self._line(abs_min_max(var, ctx))
            if has_overflow(var, ctx, self.print_fn):
                self.detected_overflow = True
        elif var is None:
            self._line(f"{'None':>17} {ctx}")
        else:
            self._line(f"{'not a tensor':>17} {ctx}")

    def _batch_start_frame(self) -> None:
        self._line(f"\n\n{_PREFIX} *** Starting batch number={self.batch_number} ***")
        self._line(f"{'abs min':8} {'abs max':8} metadata")

    def _create_frame(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._line(f"{_PREFIX} {self.module_names[module]} {module.__class__.__name__}")
        for name, p in module.named_parameters(recurse=False):
            self._analyse(p, name)
        if isinstance(inputs, tuple):
            for i, x in enumerate(inputs):
                self._analyse(x, f"input[{i}]")
        else:
            self._analyse(inputs, "input")
        if isinstance(output, tuple):
            for i, x in enumerate(output):
                if isinstance(x, tuple):
                    for j, y in enumerate(x):
                        self._analyse(y, f"output[{i}][{j}]")
                else:
                    self._analyse(x, f"output[{i}]")
        else:
            self._analyse(output, "output")
        self._save_frame()

    def _dump_saved_frames(self) -> None:
        self.print_fn(f"\nDetected inf/nan during batch_number={self.batch_number}")
        self.print_fn(f"Last {len(self.frames)} forward frames:")
        self.print_fn(f"{'abs min':8} {'abs max':8} metadata")
        self.print_fn("\n".join(self.frames))
        self.print_fn("\n\n")
        self.frames.clear()

    @torch.no_grad()
    def _forward_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        trace = self.batch_number in self.trace_batch_nums
        if trace:
            self.frames.clear()
        if self.total_calls == 0:
            self._batch_start_frame()
        self.total_calls += 1
        # the top module's hook runs last in a batch: that batch is complete
        last_of_batch = module is self.model
        if last_of_batch:
            self.batch_number += 1
        self._create_frame(module, inputs, output)
        if trace:
            self.print_fn("\n".join(self.frames))
            self.frames.clear()
        if last_of_batch:
            self._batch_start_frame()
        if self.detected_overflow and not trace:
            name = self.module_names[module] or "the model"
            self._dump_saved_frames()
            raise OverflowDetected(
                f"debug underflow_overflow: inf/nan in {name} ({module.__class__.__name__}) during batch "
                f"{self.batch_number}; the frames printed above show where the values grew."
            )
        if self.abort_after_batch_num is not None and self.batch_number > self.abort_after_batch_num:
            raise OverflowDetected(
                f"debug underflow_overflow: stopping after {self.batch_number} batches as asked by "
                f"abort_after_batch_num={self.abort_after_batch_num}."
            )
