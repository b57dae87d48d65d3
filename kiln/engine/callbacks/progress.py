"""Console feedback on the global main process: a tqdm bar with a loss/lr postfix in a terminal, one
plain line per log event when the output is a file or a pipe (no carriage returns filling a job log),
or the bare log dicts when `log.disable_tqdm` is set. `console_callbacks(config)` picks.

The plain lines are formatted and written by the loggers' background writer (kiln.loggers.writer),
the lines of each quarter second in one write. The training thread only queues each event's step,
time and log dict: formatting a line costs it ~30 µs between the steps of a small model, and
sys.stderr is unbuffered, so a write to a pipe whose reader waits (`| tee`, a container's log
collector, a benchmark harness) costs it tens of µs more, about 1% of a tiny model's step at a log
every 10 steps. A line reaches the stream at most the
writer's tick (0.25 s) late, before a checkpoint is saved, and when training ends or fails; output
written to the same stream by other code in that window can come before it. Outside fit() (a
separate evaluate or predict) lines are written at once."""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState

#: log keys shown on the bar itself; the full dict is written above it
#: the logged keys the bar shows after its counter, under these labels (throughput and MFU come with every
#: logging step where the model's tokens and FLOPs are known: kiln/engine/loop/throughput.py)
POSTFIX = {
    "loss": "loss",
    "learning_rate": "lr",
    "eval_loss": "eval_loss",
    "train_tokens_per_second": "tok/s",
    "mfu": "mfu",
}
#: the bar redraws at most this often (seconds); a step only adds to a counter and reads the clock
REFRESH_S = 0.1


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def clock(seconds: float) -> str:
    """Whole seconds as `str(timedelta)` writes them ("0:01:05", "1 day, 2:00:00"), by hand: a
    timedelta and its str() per progress line cost more than the arithmetic."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    text = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days} day{'s' if days != 1 else ''}, {text}" if days else text


def format_logs(logs: Mapping[str, Any]) -> str:
    """`loss=0.6931 learning_rate=5e-05 epoch=0.5` (total_flos left out, as HF's console does)."""
    return " ".join(f"{k}={_value(v)}" for k, v in logs.items() if k != "total_flos")


def is_interactive(stream: Any) -> bool:
    """A terminal, or a Jupyter kernel's stream (tqdm.auto draws a widget there)."""
    if "ipykernel" in type(stream).__module__:
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressCallback(Callback):
    """One bar over optimizer steps (and one per evaluation) in a terminal; in a log file, a line per
    log event: `[step 20/100  20%  0:00:04<0:00:16] loss=0.5 learning_rate=4e-05 epoch=0.2`.

    `file` is the stream (default: sys.stderr when training starts); `interactive` overrides the
    terminal detection."""

    def __init__(self, file: IO[str] | None = None, interactive: bool | None = None) -> None:
        self.file = file
        self.interactive = interactive
        self.bar: Any | None = None
        self.eval_bar: Any | None = None
        self._stream: IO[str] | None = None
        self._tty = False
        self._start: float | None = None
        self._start_step = 0
        self._lines: collections.deque[tuple[int, int, float, dict[str, Any]]] = (
            collections.deque()
        )  # lines not yet written
        self._write_lock = threading.Lock()  # the writer thread and train end both drain: one at a time, in order

    def _setup(self) -> None:
        self._stream = self.file or sys.stderr
        self._tty = self.interactive if self.interactive is not None else is_interactive(self._stream)

    def on_train_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not state.is_world_process_zero:
            return
        self._setup()
        self._start, self._start_step = time.monotonic(), state.global_step
        if self._tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=state.max_steps,
                initial=state.global_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=self._stream,
                mininterval=REFRESH_S,
            )
        else:
            start = f" from step {state.global_step}" if state.global_step else ""
            self._print(f"training {state.max_steps} steps{start}")

    def on_step_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        # O(1), no tensor read: the step count only; values reach the bar at log events
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_prediction_step(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not (state.is_world_process_zero and self._tty):
            return
        loader = kw.get("eval_dataloader")
        if self.eval_bar is None:
            try:
                total: int | None = len(loader)  # type: ignore[arg-type]
            except TypeError:
                total = None
            from tqdm.auto import tqdm

            self.eval_bar = tqdm(
                total=total, desc="eval", unit="batch", leave=self.bar is None, dynamic_ncols=True, file=self._stream
            )
        self.eval_bar.update(1)

    def _close_eval(self) -> None:
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def on_evaluate(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._close_eval()

    def on_predict(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._close_eval()

    def on_log(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self._stream is None:
            self._setup()
        logs = kw.get("logs") or {}
        if self.bar is not None:
            shown = {label: _value(logs[k]) for k, label in POSTFIX.items() if k in logs}
            if shown:
                self.bar.set_postfix(shown, refresh=False)
            self.bar.write(format_logs(logs), file=self._stream)
        elif self._tty:
            from tqdm.auto import tqdm

            tqdm.write(format_logs(logs), file=self._stream)
        elif self._start is None:  # outside fit (evaluate, predict): nothing drains later, so write now
            self._print(self._line(state.global_step, state.max_steps, time.monotonic(), logs))
        else:
            # Only the figures are queued: the writer thread formats them (formatting and the clock
            # arithmetic, run cold between training steps, cost the training thread ~30 µs a line).
            self._lines.append((state.global_step, state.max_steps, time.monotonic(), dict(logs)))
            if len(self._lines) == 1:  # the first of a batch: the writer drains what piled up by its tick
                from kiln.loggers.writer import shared_writer

                shared_writer().submit(self._drain)

    def _line(self, step: int, total: int, now: float, logs: Mapping[str, Any]) -> str:
        """`[step 20/100  20%  0:00:04<0:00:16] loss=0.5 ...`, the position as of `now`."""
        if not total or self._start is None:
            return f"[step {step}] {format_logs(logs)}"
        elapsed = now - self._start
        done = step - self._start_step
        eta = elapsed / done * (total - step) if done > 0 else None
        times = f"{clock(elapsed)}<{clock(eta) if eta is not None else '?'}"
        return f"[step {step}/{total} {100 * step // total:3d}% {times}] {format_logs(logs)}"

    def _print(self, text: str) -> None:
        self._drain()  # after the lines queued before it
        stream = self._stream
        assert stream is not None  # on_train_begin sets it before any line is printed
        stream.write(text + "\n")  # one write, then flush: a job log shows each line as it happens
        stream.flush()

    def _drain(self) -> None:
        """Write the queued lines in one write (on the writer thread, or here at the end)."""
        with self._write_lock:
            lines = self._lines
            text = "".join([self._line(*lines.popleft()) + "\n" for _ in range(len(lines))])
            if text and self._stream is not None:
                self._stream.write(text)
                self._stream.flush()

    def on_train_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._drain()
        self._close_eval()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._start = None


class PrinterCallback(Callback):
    """Prints each log dict (HF's behaviour with `disable_tqdm`), on the global main process."""

    def __init__(self, file: IO[str] | None = None) -> None:
        self.file = file

    def on_log(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if state.is_world_process_zero:
            logs = {k: v for k, v in (kw.get("logs") or {}).items() if k != "total_flos"}
            print(logs, file=self.file or sys.stdout, flush=True)


def console_callbacks(config: DictConfig) -> list[Callback]:
    """PrinterCallback when `log.disable_tqdm` is set, else ProgressCallback. Unset follows HF: the bar
    is on unless the log level is above warning (error, critical)."""
    disable = config.log.disable_tqdm
    if disable is None:
        disable = config.log.level in ("error", "critical")
    return [PrinterCallback()] if disable else [ProgressCallback()]
