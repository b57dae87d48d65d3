"""DVCLive: `<output_dir>/dvclive/` holds `params.yaml` (the flattened config), one
`plots/metrics/<section>/<name>.tsv` per metric with its steps, named with HF's sections
(`train/loss`, `eval/loss`), and `metrics.json` with the latest values. `dvc plots show` and DVC
Studio read them; the run's name is the `run_name` parameter (DVC experiments, which need a git
repository, are not created: `save_dvc_exp` is off).

A resumed job continues the files and first drops the rows a killed job wrote after the checkpoint's
step, so the curves read as if the job had never stopped. Nothing goes over the network: no Studio
live updates (`DVC_STUDIO_TOKEN` is not used), no system monitor. DVCLive itself runs `dvc init` in the
git repository holding the working directory, if any (docs/logging.md says so)."""

from __future__ import annotations

import csv
import glob
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, history_step, keep_on_resume, require

if TYPE_CHECKING:
    from omegaconf import DictConfig


def drop_rows_after(plots_dir: str, step: int) -> None:
    """Keep, in every metric file under `plots_dir`, the rows logged up to `step`."""
    for path in glob.glob(os.path.join(plots_dir, "**", "*.tsv"), recursive=True):
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh, delimiter="\t"))
        kept = [row for row in rows[1:] if keep_on_resume(history_step(row[0] if row else None), step)]
        if len(kept) < len(rows) - 1:
            with open(path, "w", newline="") as fh:
                csv.writer(fh, delimiter="\t", lineterminator="\n").writerows([rows[0], *kept])


@LOGGERS.register("dvclive")
class DVCLiveLogger(Logger):
    name = "dvclive"
    package = "dvclive"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("dvclive", "dvclive", "report_to: dvclive")
        self.base_dir = os.path.join(os.path.abspath(str(config.output_dir)), "dvclive")
        self.live: Any | None = None
        self.resume_step = 0
        self.continued = False  # finalized in this process: later logs (evaluate() after fit()) continue the files
        self.dirty = False  # logged since the last summary

    @property
    def directory(self) -> str:
        return os.path.join(self.base_dir, self.trial_name) if self.trial_name else self.base_dir

    def _start(self) -> Any:
        if self.live is None:
            from dvclive import Live

            keep = (self.resume_step > 0 or self.continued) and os.path.isdir(self.directory)
            if keep and not self.continued:
                drop_rows_after(os.path.join(self.directory, "plots", "metrics"), self.resume_step)
            # Live(resume=False) deletes the folder's earlier files: a fresh run
            self.live = Live(
                dir=self.directory, resume=keep, save_dvc_exp=False, dvcyaml=None, report=None, monitor_system=False
            )
        return self.live

    def resume(self, step: int) -> None:
        self.resume_step, self.continued = step, False

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
            self.continued = False
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._start().log_params({**params, **(self.trial_params or {})})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        live = self._start()
        live.step = step
        for key, value in metrics.items():
            live.log_metric(grouped_name(key), value)
        self.dirty = True

    def flush(self) -> None:
        if self.live is not None and self.dirty:
            self.live.make_summary()
            self.dirty = False

    def finalize(self, status: str) -> None:
        if self.live is not None:
            self.flush()
            self.live.end()
            self.live = None
            self.continued = True
