"""The measured side of the estimate's check: the live tensor bytes of a real fit on the CPU, at its peak.

PyTorch's MemTracker (a TorchDispatchMode) follows every tensor storage created while it is active, from
its creation to its release (weak references to the storages), so the figure is exactly the bytes of
live tensors, unlike the process's RSS (allocator caches, the interpreter, libraries). It is entered
before the Trainer builds anything, so the weights, DDP's gradient buckets, FSDP's gathered units and the
optimizer state are all seen; the peak over a 2-step fit is the steady step's (the first step creates the
optimizer state the second one holds)."""

from __future__ import annotations

from typing import Any

from kiln import Callback, Trainer


class _NewStep(Callback):
    """MemTracker's per-module statistics refuse a module called twice: forget them at each step."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def on_step_begin(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        self.tracker.reset_mod_stats()


def measured_peak(cfg: Any) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    from kiln.cli.task import build_task

    tracker = MemTracker()
    build, data = build_task(cfg)
    trainer = Trainer(None, cfg, model_init=build, train_dataset=data["train_dataset"], callbacks=[_NewStep(tracker)])
    with trainer, tracker:  # the Trainer's teardown ends the DDP / FSDP run's process group
        trainer.fit()
    # meta tensors (DeepSpeed makes some) hold no memory
    peaks = tracker.get_tracker_snapshot("peak")
    return sum(int(per["Total"]) for device, per in peaks.items() if device.type != "meta")
