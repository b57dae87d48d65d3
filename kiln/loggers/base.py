"""The Logger interface, plus the small helpers every logger shares.

Loggers are built on the global rank-0 process only (the Trainer builds none elsewhere), so exactly
one tracker run exists per job by construction and no logger contains rank logic. A logger checks
that its package is installed when it is built (before training starts) but opens its run lazily,
on first use, so that building one has no side effect."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any, ClassVar

from kiln.utils.errors import KilnError

if TYPE_CHECKING:
    from omegaconf import DictConfig


class MissingPackageError(KilnError, ImportError):
    """A logger named in `log.report_to` needs a package that is not installed; `extra` is the
    `pip install kiln[extra]` that brings it."""

    def __init__(self, message: str, extra: str = "") -> None:
        super().__init__(message)
        self.extra = extra


class Logger:
    """Receives flat `{name: number}` metrics with the global step, and the resolved config once.

    Life cycle, driven by LoggerCallback (every call but `capture` on its background writer thread):
    `capture` on the training thread, `set_trial` (hyperparameter search only), `resume(step)` when
    training starts, `log_hyperparams` once per run, `log_metrics` on every log event, `finalize` when
    training ends. A logger used again after `finalize` (an evaluate() after fit()) continues the same
    run, unless `set_trial` named a new trial, which starts a new run."""

    name: ClassVar[str] = "base"
    #: the tracker's package, imported when training starts (None: nothing to import)
    package: ClassVar[str | None] = None

    def __init__(self, config: DictConfig) -> None:
        self.config = config
        self.trial_name: str | None = None
        self.trial_params: dict[str, Any] | None = None

    def capture(self) -> None:
        """Called on the training thread when training starts, before any call the background writer
        runs: imports the tracker's `package` here (an import on the writer thread could still be
        running when a crash starts interpreter shutdown, where imports fail), and reads what a
        tracker keeps per thread (MLflow's active run)."""
        if self.package:
            importlib.import_module(self.package)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """`params` is the resolved config, flattened to dotted keys."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Push what `log_metrics` buffered to its destination; called after each batch of records
        (the background writer's tick), so a file is flushed once per batch, not once per record."""

    def log_artifact(self, path: str) -> None:
        """Attach a file or folder (a checkpoint, the final model) where the tracker supports it."""

    def resume(self, step: int) -> None:
        """Training (re)starts at `step`. A history a killed job left behind keeps what it logged up
        to `step` (the checkpoint's step) and drops the rest, so kill-and-resume ends with the same
        history as a run that never stopped; `step == 0` is a fresh start."""

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        """A hyperparameter-search trial begins: the next run is this trial's run."""
        self.trial_name = name
        self.trial_params = dict(params) if params else None

    def finalize(self, status: str) -> None:
        """Flush and close; `status` is "success", "failed" or "interrupted"."""


class AppendFile:
    """A history file held open for appending between writes, flushed by `flush()` after each batch
    of records (`tail -f` shows a batch as it is written; the writer writes one at least every
    quarter second), and opened once, not per record: opening, checking and closing it cost several
    times what the write does, on the writer thread, which holds the GIL the training thread needs.
    `close()` before the file is replaced or the run ends; the next write opens it again (creating
    its folder if it is gone)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.handle: IO[str] | None = None

    def open(self) -> IO[str]:
        if self.handle is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.handle = open(self.path, "a", encoding="utf-8", newline="")
        return self.handle

    def write(self, text: str) -> None:
        self.open().write(text)

    def flush(self) -> None:
        if self.handle is not None:
            self.handle.flush()

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.close()

    def __del__(self) -> None:
        self.close()


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1e-3}} -> {'optim.lr': 1e-3}; lists become strings."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = str(list(value))
        else:
            out[name] = value
    return out


def grouped_name(key: str) -> str:
    """HF's `rewrite_logs` for dashboards with sections: eval_loss -> eval/loss, test_acc -> test/acc,
    anything else -> train/<key>. TensorBoard and W&B use it; files and MLflow keep the raw names."""
    for prefix in ("eval", "test"):
        if key.startswith(prefix + "_"):
            return f"{prefix}/{key[len(prefix) + 1 :]}"
    return f"train/{key}"


def require(package: str, extra: str, what: str) -> None:
    """Fail now (for a logger: when it is built, before training) if `package` is missing; importing
    it is left to first use, as tracker packages take seconds to import. `what` names the feature."""
    if importlib.util.find_spec(package) is None:
        raise MissingPackageError(
            f"{what} needs the `{package}` package, which is not installed: pip install kiln[{extra}]", extra
        )


def setting(config: DictConfig, key: str, env: str | None = None, default: Any = None) -> Any:
    """A tracker option: `log.<key>` when the config has it and it is set, else the environment variable
    the outside world sets for that tracker (HF's names, e.g. MLFLOW_EXPERIMENT_NAME), else `default`.
    A boolean default parses the variable as 1/true/yes."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, f"log.{key}", default=None)
    if value is not None:
        return value
    raw = os.environ.get(env) if env else None
    if raw is None or raw == "":
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return raw


def run_name(config: DictConfig) -> str:
    """`run_name`, or the output directory's name as HF does; a value from `${oc.env:VAR}` is shown as
    that interpolation, as in the logged hyperparameters (kiln.config.redact)."""
    from kiln.config.redact import mask

    name = config.get("run_name")
    return mask(str(name) if name else os.path.basename(os.path.abspath(str(config.output_dir))))


def run_files_dir(config: DictConfig) -> str:
    """Where the run files (metrics.csv, metrics.jsonl) go: `log.logging_dir`, else `output_dir/runs`,
    the folder HF's logging dir lives in. Never `output_dir` itself, beside the checkpoint folders.
    Fixed (no date stamp), so a resumed job finds and continues the killed job's files."""
    configured = config.log.get("logging_dir")
    return str(configured) if configured else os.path.join(str(config.output_dir), "runs")


def history_step(value: Any) -> int | None:
    """The step stored in one history row, or None for a row that cannot be read (a torn last line)."""
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def keep_on_resume(row_step: int | None, resume_step: int) -> bool:
    """Whether a row a previous job wrote survives `resume(resume_step)`."""
    return resume_step > 0 and row_step is not None and row_step <= resume_step
