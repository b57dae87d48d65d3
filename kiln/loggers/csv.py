"""`metrics.csv` in the run-files directory (`log.logging_dir`, else `output_dir/runs`): one row per log call, a `step` column first, then one column
per metric in the order the names first appear. A new name grows the header (the file is rewritten
once); other rows are appended. A resumed run keeps the rows logged up to its checkpoint's step and
drops the rest, so a killed-and-resumed run ends with the same file as one that never stopped."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import AppendFile, Logger, history_step, keep_on_resume, run_files_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig


@LOGGERS.register("csv")
class CSVLogger(Logger):
    name = "csv"
    filename = "metrics.csv"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        self.path = os.path.join(run_files_dir(config), self.filename)
        self.file = AppendFile(self.path)
        self._writer: Any = None  # a DictWriter on the open file, for the current columns
        # Rows are kept as the strings the file holds, so rewriting the file reproduces it byte for byte.
        self.previous: list[dict[str, str]] = []  # rows an earlier job wrote
        self.rows: list[dict[str, Any]] = []  # rows this process wrote
        self.columns: list[str] = ["step"]
        self.dirty = False  # the file ends in a torn row and must be rewritten before appending
        if os.path.exists(self.path):
            with open(self.path, newline="") as fh:
                text = fh.read()
            complete = text if text.endswith("\n") or not text else text[: text.rfind("\n") + 1]
            self.dirty = complete != text
            reader = csv.DictReader(io.StringIO(complete, newline=""))
            self.columns = list(reader.fieldnames or ["step"])
            self.previous = [row for row in reader if history_step(row.get("step")) is not None]

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new or self.dirty or (self.file.handle is None and not os.path.exists(self.path)):
            self.columns += new
            self._rewrite()
            return
        if self._writer is None or self.file.handle is None:
            self._writer = csv.DictWriter(self.file.open(), self.columns)
        self._writer.writerow(row)

    def flush(self) -> None:
        self.file.flush()

    def resume(self, step: int) -> None:
        kept = [row for row in self.previous if keep_on_resume(history_step(row["step"]), step)]
        if len(kept) == len(self.previous) and not self.dirty:
            return
        self.previous = kept
        # The header is what an uninterrupted run would have: names in order of first appearance.
        columns = ["step"]
        for row in [*kept, *self.rows]:
            columns += [k for k, v in row.items() if k is not None and k not in columns and v not in ("", None)]
        self.columns = columns
        self._rewrite()

    def finalize(self, status: str) -> None:
        self.file.close()

    def _rewrite(self) -> None:
        self.file.close()  # the file is replaced (and its columns may change): the next row opens the new one
        self._writer = None
        self.dirty = False
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            writer = csv.DictWriter(fh, self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows([*self.previous, *self.rows])
        os.replace(tmp, self.path)
