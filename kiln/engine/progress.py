"""Console feedback: a tqdm progress bar on the main process, or plain printed logs without it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional

from kiln.engine.callbacks import Callback

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.state import TrainerControl, TrainerState


def _fmt(logs: dict[str, Any]) -> dict[str, str]:
    return {k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in logs.items()}


class ProgressCallback(Callback):
    """One tqdm bar over optimizer steps, on the global main process only."""

    def __init__(self) -> None:
        self.bar: Optional[Any] = None

    def on_train_begin(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            interactive = sys.stderr.isatty()
            # In a log file, redraw rarely so the file does not fill with carriage-return lines.
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True,
                            mininterval=0.1 if interactive else 30.0, desc="train")

    def on_step_end(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        logs = kw.get("logs") or {}
        if self.bar is not None:
            shown = {k: logs[k] for k in ("loss", "learning_rate", "eval_loss") if k in logs}
            if shown:
                self.bar.set_postfix(_fmt(shown), refresh=False)
            if "train_runtime" in logs or "eval_loss" in logs:
                self.bar.write(str(_fmt(logs)))

    def on_train_end(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrinterCallback(Callback):
    """Prints each log dict when the progress bar is disabled."""

    def on_log(self, config: "DictConfig", state: "TrainerState", control: "TrainerControl", **kw: Any) -> None:
        if state.is_world_process_zero:
            print(_fmt(kw.get("logs") or {}), flush=True)


def console_callbacks(config: "DictConfig") -> list[Callback]:
    """The progress bar, or printed logs when `log.disable_tqdm` is set."""
    return [PrinterCallback()] if config.log.disable_tqdm else [ProgressCallback()]
