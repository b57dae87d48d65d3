"""What the fit loop measures: samples, tokens and FLOPs per optimizer step, HF's `total_flos`, and the
figures it reports from them (samples/s, steps/s, tokens/s, TFLOP/s, MFU, peak memory) at each logging step
and at the end of the run. Only logging steps and the end read anything across ranks."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from kiln.accelerators.peaks import peak_tflops
from kiln.engine.loop.flops import FlopCount
from kiln.engine.loop.peak_memory import WindowPeakMemory
from kiln.engine.loop.running_loss import sum_over_ranks
from kiln.engine.loop.step import batch_tokens
from kiln.engine.loop.throughput import Throughput
from kiln.strategies.interfaces import ReportsStepFigures
from kiln.utils.tensors import batch_size_of

if TYPE_CHECKING:
    from kiln.engine.callbacks.state import TrainerState
    from kiln.engine.run import Run
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy


class FitMeter:
    """The counters of one fit; `begin(start)` starts the first logging window."""

    def __init__(self, run: Run, strategy: Strategy, config: Any, memory_tracker: Any) -> None:
        self.strategy, self.config = strategy, config
        self.count_tokens_seen = bool(config.train.include_num_input_tokens_seen)
        self.flops = FlopCount(run.model)  # total_flos, HF's count (loop/flops.py)
        self.throughput = Throughput(run.model, self._peak_tflops())  # tokens/s, TFLOP/s, MFU (loop/throughput.py)
        # the strategy's own figures for the loggers (expert parallelism's tokens per expert), asked for once
        self.strategy_figures = strategy if isinstance(strategy, ReportsStepFigures) else None
        self.run_flops = 0.0  # the logged windows' FLOPs, summed over ranks (for the end-of-run TFLOP/s and MFU)
        self.peak_memory = WindowPeakMemory(strategy.accelerator, memory_tracker)  # per window; CUDA
        self.local_flos = 0.0

    def begin(self, start: float) -> None:
        self.samples, self.tokens = 0, 0
        self.window_start, self.samples_at_log = start, 0

    def count(self, window: list[Any], state: TrainerState, loaded: list[Any]) -> None:
        """Samples, tokens and FLOPs of the window (for throughput and total_flos), and num_input_tokens_seen.

        `window` is the micro-batches as the step ran them (after `batch_to_device`), `loaded` the same
        micro-batches as the loader gave them. num_input_tokens_seen counts `loaded`'s input tokens, as HF
        counts the batch's before any split: a strategy that splits each data shard's batch over its item
        shards may pad it first (context parallel pads packed rows to a length its split divides), and the
        chunks' tokens would count that padding."""
        tokens = 0
        for batch in window:
            self.samples += batch_size_of(batch)
            tokens += batch_tokens(batch)
            self.local_flos += self.flops.count(batch)
            self.throughput.count(batch)
        self.tokens += tokens
        if self.count_tokens_seen:  # a host read per step only when several shards must be summed (as HF)
            seen, strategy = sum(batch_tokens(batch) for batch in loaded), self.strategy
            if strategy.item_shards > 1:
                total = int(strategy.reduce(torch.tensor(seen, device=strategy.root_device), "sum").item())
                # each data shard's batch is loaded whole on each of its item shards (under cp: its cp ranks)
                seen = total // (strategy.item_shards // strategy.data_shards)
            state.num_input_tokens_seen += seen

    def flush_flos(self, state: TrainerState) -> None:
        """Add this window's FLOPs, summed over ranks, to state.total_flos (before logs and saves)."""
        strategy = self.strategy
        if strategy.world_size > 1:
            self.local_flos = float(
                strategy.reduce(
                    torch.tensor(self.local_flos, dtype=torch.float64, device=strategy.root_device), "sum"
                ).item()
            )
        state.total_flos += self.local_flos
        self.local_flos = 0.0

    def window_figures(self, steps: int, precision: Precision) -> dict[str, float]:
        """The figures of the `steps` optimizer steps since the last logging step, for the loggers, and a new
        window. This window's tokens and FLOPs are summed as the strategy sums (tensor-parallel copies count
        once)."""
        strategy = self.strategy
        tokens, flops = sum_over_ranks(list(self.throughput.take()), strategy)
        self.run_flops += flops
        figures: dict[str, float] = {}
        if precision.uses_grad_scaler:
            figures["skipped_steps"] = float(precision.skipped_steps)  # inf/nan steps the scaler skipped
        now = time.perf_counter()
        elapsed = max(now - self.window_start, 1e-9)
        world = strategy.data_shards
        figures["samples_per_second"] = (self.samples - self.samples_at_log) * world / elapsed
        figures["steps_per_second"] = steps / elapsed
        figures.update(self.throughput.figures(tokens, flops, elapsed, strategy.world_size))
        if self.strategy_figures is not None:
            figures.update(self.strategy_figures.step_figures(steps))
        figures.update(self.peak_memory.take())
        self.window_start, self.samples_at_log = now, self.samples
        return figures

    def run_throughput(self, runtime: float) -> dict[str, float]:
        """The whole fit's train_tflops (the job's and per rank) and train_mfu, from the logged windows' FLOPs
        and the unlogged rest (one reduction, at the end: no read between logging steps)."""
        _, rest = sum_over_ranks(list(self.throughput.take()), self.strategy)
        figures = self.throughput.figures(0, self.run_flops + rest, runtime, self.strategy.world_size)
        return {("train_mfu" if key == "mfu" else key): value for key, value in figures.items()}

    def _peak_tflops(self) -> float | None:
        """One device's peak for MFU: `log.mfu_peak_tflops`, else the table's for this GPU and precision."""
        cfg, strategy = self.config, self.strategy
        if cfg.log.mfu_peak_tflops:
            return float(cfg.log.mfu_peak_tflops)
        name = strategy.accelerator.device_name(strategy.root_device)
        return peak_tflops(name, cfg.precision.name, bool(cfg.precision.tf32))
