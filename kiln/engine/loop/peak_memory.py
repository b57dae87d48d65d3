"""The device's peak allocation over each logging window, logged with the throughput figures
(`peak_memory_gib`): the largest any step of the window reached, which HF's per-stage memory metrics
(one figure for the whole fit, and only with `log.skip_memory_metrics: false`) cannot show.

Read from the accelerator's allocator counters (CUDA's `max_memory_allocated`), a host-side read that
waits for no kernel, then the counter is reset for the next window. A device without counters (the
CPU) logs nothing. The stage peak HF's metrics report is kept whole: each window's peak is handed to
the memory tracker, which reports the largest."""

from __future__ import annotations

from typing import Any

GIB = 2**30


class WindowPeakMemory:
    def __init__(self, accelerator: Any, tracker: Any) -> None:
        self.device = accelerator if accelerator.has_memory_stats() else None
        self.tracker = tracker

    def take(self) -> dict[str, float]:
        """{"peak_memory_gib": the window's peak} (empty without counters), and a new window."""
        if self.device is None:
            return {}
        peak = int(self.device.max_memory_allocated())
        self.device.reset_peak_memory_stats()
        self.tracker.note_device_peak(peak)
        return {"peak_memory_gib": peak / GIB}
