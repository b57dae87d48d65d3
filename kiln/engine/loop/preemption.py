"""Preemption (HF's `enable_jit_checkpoint`, kiln's `save.on_preemption`): when the cluster sends
SIGTERM, save a checkpoint at the next step boundary on every rank, finish writing it, and stop
training as HF's JIT checkpoint does: `train()` ends as after its last step (`on_train_end` runs, a
TrainOutput is returned) and the script decides what comes next. `kiln fit` then exits 0 at once,
without the evaluation and export that follow a finished run.

The signal handler only sets a flag: nothing unsafe (I/O, collectives) runs inside it. At each step
boundary the loop asks `requested()`, which agrees across ranks with one scalar max-reduce, because
a cluster signals each rank at a slightly different moment and every rank must save the same step
(a rank that saved alone would wait forever in the checkpoint's barriers). That all-reduce is the
feature's only cost, paid only when it is switched on and only with more than one process. The checkpoint is an ordinary one, so the
resumed run is exactly the uninterrupted one."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)


class Preemption:
    """Install with `with Preemption(strategy, enabled):` around training; the previous SIGTERM
    handler is put back on exit."""

    def __init__(self, strategy: Strategy, enabled: bool) -> None:
        self.strategy = strategy
        self.enabled = enabled
        self.signalled = False  # this process got SIGTERM
        self.triggered = False  # every rank agreed to save and stop
        self._previous: Any = None

    def __enter__(self) -> Preemption:
        if self.enabled:
            if threading.current_thread() is not threading.main_thread():
                log.warning(
                    "save.on_preemption is ignored: fit() does not run in the main thread, where Python "
                    "delivers signals."
                )
                self.enabled = False
            else:
                self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def requested(self) -> bool:
        """Whether any rank got SIGTERM (the same answer on every rank; a collective when distributed)."""
        if not self.enabled:
            return False
        if self.strategy.world_size == 1:  # nothing to agree on: no tensor, no device read, every step
            self.triggered = self.signalled
            return self.triggered
        flag = torch.tensor(1.0 if self.signalled else 0.0, device=self.strategy.root_device)
        self.triggered = bool(self.strategy.reduce(flag, "max").item() > 0)
        return self.triggered

    def stop(self, step: int) -> None:
        """After the checkpoint is complete on every rank: say so; the loop then ends training (HF's
        JIT checkpoint sets should_training_stop; `train()` returns normally)."""
        log.warning(
            "Preempted (SIGTERM): saved checkpoint-%d on every rank; training stops here. Resume with "
            "resume_from_checkpoint=true.",
            step,
        )
