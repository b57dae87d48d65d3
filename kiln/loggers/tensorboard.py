"""TensorBoard event files, written by `torch.utils.tensorboard.SummaryWriter`.

Where: `log.logging_dir`, else HF's default `output_dir/runs/<Mon DD_HH-MM-SS>_<host>`; a
hyperparameter-search trial writes to a sub-folder named after the trial, as HF does. What: one
scalar per logged metric, named with HF's sections (`train/loss`, `eval/loss`), the flattened config
as hyperparameters (HParams dashboard) and as a text table. A resumed run continues the newest
run folder and tells TensorBoard to purge the events a killed job wrote after the checkpoint's step
(`purge_step`), so its curves read as if the job had never stopped."""

from __future__ import annotations

import datetime
import glob
import os
import re
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require

if TYPE_CHECKING:
    from omegaconf import DictConfig


def default_logdir(output_dir: str) -> str:
    """HF's `output_dir/runs/CURRENT_DATETIME_HOSTNAME`."""
    stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
    return os.path.join(output_dir, "runs", f"{stamp}_{socket.gethostname()}")


def _wait_to_sort_last(log_dir: str) -> None:
    """TensorBoard reads a run's event files in name order, and a name starts with the second the file
    was created: a writer reopened in the same second as the previous one closed (evaluate() right
    after fit(), a resume inside one process) could be read first. Wait for the next second then."""
    names = os.listdir(log_dir) if os.path.isdir(log_dir) else []
    stamps = [int(m.group(1)) for n in names if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", n))]
    if stamps:
        delay = max(stamps) + 1 - time.time()
        if delay > 0:
            time.sleep(delay)


def _hparam_value(value: Any) -> Any:
    """The HParams plugin takes bool, int, float and str; anything else is shown as its str()."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


@LOGGERS.register("tensorboard")
class TensorBoardLogger(Logger):
    name = "tensorboard"
    package = "torch.utils.tensorboard"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("tensorboard", "tensorboard", "report_to: tensorboard")
        self.configured_dir: str | None = config.log.logging_dir
        self.base_dir = self.configured_dir or default_logdir(str(config.output_dir))
        self.writer: Any | None = None
        self.purge_step: int | None = None

    @property
    def log_dir(self) -> str:
        return os.path.join(self.base_dir, self.trial_name) if self.trial_name else self.base_dir

    def _open(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            _wait_to_sort_last(self.log_dir)
            self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=self.purge_step)
            self.purge_step = None
        return self.writer

    def resume(self, step: int) -> None:
        if step <= 0 or self.writer is not None:
            return
        if self.configured_dir is None and not self.trial_name:
            runs = [d for d in glob.glob(os.path.join(str(self.config.output_dir), "runs", "*")) if os.path.isdir(d)]
            if runs:  # continue the killed job's run instead of starting a second curve
                self.base_dir = max(runs, key=os.path.getmtime)
        self.purge_step = step + 1

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        writer = self._open()
        values = {k: _hparam_value(v) for k, v in {**params, **(self.trial_params or {})}.items()}
        # Only the session-start summary: without an experiment summary the HParams dashboard lists
        # every scalar of the run as a metric, which is what a user wants to compare.
        _, session_start, _ = hparams(values, {})
        writer.file_writer.add_summary(session_start)
        table = "\n".join(f"| {k} | {v} |" for k, v in values.items())
        writer.add_text("config", "| key | value |\n|---|---|\n" + table)
        writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        writer = self._open()
        for key, value in metrics.items():
            writer.add_scalar(grouped_name(key), value, step)
        writer.flush()

    def finalize(self, status: str) -> None:
        if self.writer is not None:
            if status == "success":
                from torch.utils.tensorboard.summary import hparams

                _, _, session_end = hparams({}, {})
                self.writer.file_writer.add_summary(session_end)
            self.writer.close()
            self.writer = None
