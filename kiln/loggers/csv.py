"""`metrics.csv` in the output directory: one row per log call, columns grow as new metrics appear."""

from __future__ import annotations

import csv
import os
from typing import TYPE_CHECKING, Any, Mapping

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger

if TYPE_CHECKING:
    from omegaconf import DictConfig


@LOGGERS.register("csv")
class CSVLogger(Logger):
    name = "csv"
    filename = "metrics.csv"

    def __init__(self, config: "DictConfig") -> None:
        super().__init__(config)
        self.path = os.path.join(config.output_dir, self.filename)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        if os.path.exists(self.path):  # a resumed run continues its file
            with open(self.path, newline="") as fh:
                reader = csv.DictReader(fh)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new or not os.path.exists(self.path):
            self.columns += new
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as fh:
                csv.DictWriter(fh, self.columns).writerow(row)

    def _rewrite(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
