"""The run-level numbers HF reports, with HF's names: speed (`<split>_runtime`,
`<split>_samples_per_second`, ...), memory deltas (`<stage>_mem_{cpu,gpu}_{alloc,peaked}_delta`), and
the aligned `key = value` block `log_metrics` prints."""

from __future__ import annotations

import datetime
import gc
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


def speed_metrics(
    split: str,
    start_time: float,
    num_samples: int | None = None,
    num_steps: int | None = None,
    num_tokens: int | None = None,
    end_time: float | None = None,
) -> dict[str, float]:
    """HF's speed metrics for `split` ("train", "eval", "test"). `start_time` comes from `time.time()`;
    `end_time` defaults to now. Rates are omitted for a zero runtime."""
    runtime = (time.time() if end_time is None else end_time) - start_time
    result = {f"{split}_runtime": round(runtime, 4)}
    if runtime <= 0:
        return result
    for name, count in (("samples", num_samples), ("steps", num_steps), ("tokens", num_tokens)):
        if count is not None:
            result[f"{split}_{name}_per_second"] = round(count / runtime, 3)
    return result


def _secs2timedelta(secs: float) -> str:
    """12.5 -> '0:00:12.50' (HF's runtime format)."""
    msec = int(abs(secs - int(secs)) * 100)
    return f"{datetime.timedelta(seconds=int(secs))}.{msec:02d}"


def metrics_format(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Human-readable copies of the values, as HF: memory in MB, runtimes as h:mm:ss.xx, total_flos in
    GF, other floats rounded to 4 decimals."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if "_mem_" in key and isinstance(value, (int, float)):
            out[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key and isinstance(value, (int, float)):
            out[key] = _secs2timedelta(value)
        elif key == "total_flos" and isinstance(value, (int, float)):
            out[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            out[key] = round(value, 4)
        else:
            out[key] = value
    return out


def format_log_metrics(split: str, metrics: Mapping[str, Any]) -> str:
    """The block HF's `log_metrics` prints: a header, then sorted `key = value` lines with the keys
    left-aligned and the values right-aligned in their columns."""
    formatted = metrics_format(metrics)
    lines = [f"***** {split} metrics *****"]
    if formatted:
        k_width = max(len(str(k)) for k in formatted)
        v_width = max(len(str(v)) for v in formatted.values())
        lines += [f"  {key: <{k_width}} = {str(formatted[key]):>{v_width}}" for key in sorted(formatted)]
    return "\n".join(lines)


class MemoryTracker:
    """HF's TrainerMemoryTracker: CPU RAM (RSS, with a sampling thread for the peak) and accelerator
    memory (torch's allocator counters for device 0) per stage.

    `start("train")` ... `stop_and_update("train", metrics)` adds `train_mem_cpu_alloc_delta`,
    `train_mem_cpu_peaked_delta`, `train_mem_gpu_alloc_delta`, `train_mem_gpu_peaked_delta` (bytes).
    alloc_delta = end - start (may be negative); peaked_delta = peak - end (never negative), so a stage
    needed alloc_delta + peaked_delta. The "init" stage is folded into the first stage that reports.
    Not re-entrant: a stage started inside another (eval inside train) is ignored and counted in the
    outer one. Every method is a no-op when `skip_memory_metrics` is true (HF's default) or psutil is
    missing. It resets torch's peak-memory counters, which other profilers also use."""

    def __init__(self, skip_memory_metrics: bool = False, sample_interval: float = 0.001) -> None:
        self.skip = skip_memory_metrics
        self.sample_interval = sample_interval
        self.process: Any = None
        if not self.skip:
            try:
                import psutil
            except ImportError:
                log.warning("Memory metrics need psutil (pip install psutil); skipping them.")
                self.skip = True
            else:
                self.process = psutil.Process()
        self.stage: str | None = None
        self.cpu: dict[str, dict[str, int]] = {}
        self.gpu: dict[str, dict[str, int]] = {}
        self.init_reported = False
        self._peak = 0
        self._device_peak = 0  # the largest window peak the fit loop read (and reset) during the stage
        self._monitoring = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: Any) -> MemoryTracker:
        return cls(skip_memory_metrics=bool(config.log.skip_memory_metrics))

    # -- accelerator counters (the first accelerator of this process that keeps them) --------------
    @staticmethod
    def _device() -> Any:
        import sys

        if "torch" not in sys.modules:  # no accelerator counters without torch already in use
            return None
        from kiln.accelerators import available_accelerators

        return next((a for a in available_accelerators() if a.has_memory_stats()), None)

    def _rss(self) -> int:
        return int(self.process.memory_info().rss)

    def _sample_peak(self) -> None:
        while self._monitoring:
            self._peak = max(self._rss(), self._peak)
            time.sleep(self.sample_interval)

    # -- stages ---------------------------------------------------------------------------------
    def start(self, stage: str) -> None:
        if self.skip or self.stage is not None:
            return
        self.stage = stage
        gc.collect()
        device = self._device()
        if device is not None:
            device.reset_peak_memory_stats()
            self._device_peak = 0
            device.empty_cache()
            self.gpu[stage] = {"begin": int(device.memory_allocated())}
        self.cpu[stage] = {"begin": self._rss()}
        self._peak = self.cpu[stage]["begin"]
        self._monitoring = True
        self._thread = threading.Thread(target=self._sample_peak, daemon=True, name="kiln-memory-peak")
        self._thread.start()

    def stop(self, stage: str) -> None:
        if self.skip or self.stage != stage:
            return
        self._monitoring = False
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        gc.collect()
        device = self._device()
        if device is not None and stage in self.gpu:
            end = int(device.memory_allocated())
            peak = max(int(device.max_memory_allocated()), self._device_peak)
            g = self.gpu[stage]
            g.update(end=end, peak=peak, alloc=end - g["begin"], peaked=max(0, peak - end))
        end = self._rss()
        c = self.cpu[stage]
        c.update(end=end, peak=self._peak, alloc=end - c["begin"], peaked=max(0, self._peak - end))
        self.stage = None

    def note_device_peak(self, peak: int) -> None:
        """A peak read before the device's counter was reset (the fit's per-window peak memory): the
        stage's peak is the largest of these and what the counter holds at its end."""
        self._device_peak = max(self._device_peak, peak)

    def update_metrics(self, stage: str, metrics: dict[str, Any]) -> None:
        if self.skip or stage == "init":  # init has no metrics of its own: the first stage reports it
            return
        stages = [stage]
        if not self.init_reported and "alloc" in self.cpu.get("init", {}):
            stages.insert(0, "init")
            self.init_reported = True
        for name in stages:
            for kind in ("alloc", "peaked"):
                if kind in self.cpu.get(name, {}):
                    metrics[f"{name}_mem_cpu_{kind}_delta"] = self.cpu[name][kind]
                if kind in self.gpu.get(name, {}):
                    metrics[f"{name}_mem_gpu_{kind}_delta"] = self.gpu[name][kind]
        if stages[0] == "init":  # where memory stood when the Trainer was created
            metrics["before_init_mem_cpu"] = self.cpu["init"]["begin"]
            if "init" in self.gpu:
                metrics["before_init_mem_gpu"] = self.gpu["init"]["begin"]

    def stop_and_update(self, stage: str, metrics: dict[str, Any]) -> None:
        """Stop `stage` (if it is the running one) and add its numbers to `metrics`."""
        if self.skip:
            return
        was_running = self.stage == stage
        self.stop(stage)
        if was_running:
            self.update_metrics(stage, metrics)
