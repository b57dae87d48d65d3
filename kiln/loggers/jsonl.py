"""`metrics.jsonl` in the run-files directory (`log.logging_dir`, else `output_dir/runs`): one JSON object per log call, `{"step": N, **metrics}`,
appended and flushed as it happens (`tail -f` works). Non-finite values are written as NaN/Infinity,
as Python's json and trainer_state.json do. Resume drops the lines a killed job logged after the
checkpoint's step, like the CSV file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kiln.loggers import LOGGERS
from kiln.loggers.base import AppendFile, Logger, history_step, keep_on_resume, run_files_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig


def _line_step(line: str) -> int | None:
    try:
        return history_step(json.loads(line).get("step"))
    except (ValueError, AttributeError):
        return None  # a torn last line from a killed job


@LOGGERS.register("jsonl")
class JSONLLogger(Logger):
    name = "jsonl"
    filename = "metrics.jsonl"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        self.path = os.path.join(run_files_dir(config), self.filename)
        self.file = AppendFile(self.path)
        self.previous: list[str] = []  # lines an earlier job wrote, verbatim
        self.written: list[str] = []  # lines this process wrote
        self.dirty = False  # the file holds a torn line and must be rewritten before appending
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as fh:
                lines = fh.read().splitlines(keepends=True)
            self.previous = [
                line.rstrip("\n") for line in lines if line.endswith("\n") and _line_step(line) is not None
            ]
            self.dirty = len(self.previous) != len(lines)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        line = json.dumps({"step": step, **metrics})
        self.written.append(line)
        if self.dirty:
            self._rewrite()
            return
        self.file.write(line + "\n")

    def flush(self) -> None:
        self.file.flush()

    def resume(self, step: int) -> None:
        kept = [line for line in self.previous if keep_on_resume(_line_step(line), step)]
        if len(kept) != len(self.previous) or self.dirty:
            self.previous = kept
            self._rewrite()

    def finalize(self, status: str) -> None:
        self.file.close()

    def _rewrite(self) -> None:
        self.file.close()  # the file is replaced: the next append opens the new one
        self.dirty = False
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(line + "\n" for line in [*self.previous, *self.written])
        os.replace(tmp, self.path)
