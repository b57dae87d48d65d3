"""MLflow: one run with the flattened config as params and every metric with its step.

Where: the tracking URI the outside world configured (`MLFLOW_TRACKING_URI`, `mlflow.set_tracking_uri`,
or the store of a run the caller already started); otherwise a local store inside the output
directory, `sqlite:///<output_dir>/mlflow.db` with artifacts under `<output_dir>/mlruns/` (MLflow 3
refuses new plain-folder `mlruns` stores; `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`
browses it).

Which run, as HF's MLflowCallback: `MLFLOW_RUN_ID` continues that run; a run the caller started with
`mlflow.start_run()` receives the logs (and stays open), or, with `nested_run`, gets a child run;
otherwise a new run named `run_name` (default: the output directory's name). Hyperparameter-search
trials are child runs of one parent run per search (the caller's active run, or one kiln creates).
Everything goes through an `MlflowClient` bound to that store, so nothing global is changed."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, require, run_name, setting

if TYPE_CHECKING:
    from omegaconf import DictConfig

_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
_SEARCH_PARENTS: dict[tuple[str, str, str], str] = {}  # (uri, experiment, name) -> parent run id


def _limits() -> tuple[int, int, int, int]:
    """(param value length, params per batch, metrics per batch, key length) of the installed MLflow
    (value length was 250, then 500, now 6000)."""
    try:
        from mlflow.utils import validation as v

        return v.MAX_PARAM_VAL_LENGTH, v.MAX_PARAMS_TAGS_PER_BATCH, v.MAX_METRICS_PER_BATCH, v.MAX_ENTITY_KEY_LENGTH
    except (ImportError, AttributeError):
        return 250, 100, 1000, 250


def metric_key(key: str) -> str:
    """MLflow accepts letters, digits, `_ - . / ` and spaces in names; anything else becomes `_`."""
    return re.sub(r"[^\w\-./ ]", "_", key)


@LOGGERS.register("mlflow")
class MLflowLogger(Logger):
    name = "mlflow"
    package = "mlflow"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("mlflow", "mlflow", "report_to: mlflow")
        self.output_dir = os.path.abspath(str(config.output_dir))
        self.experiment_name: str | None = setting(config, "project", "MLFLOW_EXPERIMENT_NAME")
        self.nested: bool = bool(setting(config, "nested_run", "MLFLOW_NESTED_RUN", False))
        self.tags: dict[str, Any] = json.loads(os.environ.get("MLFLOW_TAGS") or "{}")
        self.continue_run_id: str | None = os.environ.get("MLFLOW_RUN_ID") or None
        self.client: Any = None  # an MlflowClient bound to the run's store, once started
        self.run_id: str | None = None
        self.owns_run = False  # False when logging into a run the caller started (they end it)
        self.live = False  # started or resumed, and not yet finalized
        self.resumed_from: int | None = None
        self.caller_run: Any = None  # the run the caller started on the training thread (MLflow's is per thread)

    # -- the run ------------------------------------------------------------------------------
    def capture(self) -> None:
        super().capture()
        import mlflow

        self.caller_run = mlflow.active_run()

    def _active_run(self) -> Any:
        import mlflow

        return mlflow.active_run() or self.caller_run

    @property
    def local_uri(self) -> str:
        return "sqlite:///" + os.path.join(self.output_dir, "mlflow.db")

    @property
    def tracking_uri(self) -> str:
        import mlflow

        uri_set = getattr(mlflow, "is_tracking_uri_set", lambda: False)()
        if os.environ.get("MLFLOW_TRACKING_URI") or uri_set or self._active_run():
            return mlflow.get_tracking_uri()
        return self.local_uri

    def _experiment_id(self, uri: str) -> str:
        local = uri == self.local_uri
        name = self.experiment_name or ("kiln" if local else "Default")
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        os.makedirs(self.output_dir, exist_ok=True)
        # A local store keeps artifacts next to it, not in the current directory.
        location = pathlib.Path(self.output_dir, "mlruns").as_uri() if local else None
        return self.client.create_experiment(name, artifact_location=location)

    def _start(self) -> str:
        if self.run_id is not None:
            return self.run_id
        self.live = True
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(uri[len("sqlite:///") :]) or ".", exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        active = self._active_run()
        if self.continue_run_id:
            self.run_id, self.owns_run = self.continue_run_id, True
            self.client.update_run(self.run_id, status="RUNNING")
            return self.run_id
        if active is not None and not (self.nested or self.trial_name):
            self.run_id, self.owns_run = active.info.run_id, False
            return self.run_id
        experiment = active.info.experiment_id if active is not None else self._experiment_id(uri)
        tags = {**self.tags, "kiln.output_dir": self.output_dir}
        if self.resumed_from:
            tags["kiln.resumed_from_step"] = self.resumed_from
        parent = active.info.run_id if active is not None else None
        if self.trial_name and parent is None:
            parent = self._search_parent(uri, experiment)
        if parent is not None:
            tags["mlflow.parentRunId"] = parent
        name = self.trial_name or run_name(self.config)
        run = self.client.create_run(experiment, run_name=name, tags={k: str(v) for k, v in tags.items()})
        self.run_id, self.owns_run = run.info.run_id, True
        return self.run_id

    def _search_parent(self, uri: str, experiment: str) -> str:
        """One parent run per search in this process, so trials are grouped; ended at exit."""
        key = (uri, experiment, run_name(self.config))
        if key not in _SEARCH_PARENTS:
            run = self.client.create_run(experiment, run_name=key[2], tags={"kiln.output_dir": self.output_dir})
            _SEARCH_PARENTS[key] = run.info.run_id
            atexit.register(self.client.set_terminated, run.info.run_id, "FINISHED")
        return _SEARCH_PARENTS[key]

    # -- Logger interface ---------------------------------------------------------------------
    def resume(self, step: int) -> None:
        # MLflow cannot delete logged points, so a resumed job gets a new run (unless MLFLOW_RUN_ID).
        self.resumed_from = step if step > 0 else None
        if self.run_id is not None and self.owns_run and not self.live:  # fit() again in this process
            self.client.update_run(self.run_id, status="RUNNING")
            self.live = True

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name and self.run_id is not None:
            self.finalize("success")
            self.run_id = None
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self._start()
        max_value, per_batch, _, max_key = _limits()
        values = {
            k: str(v)[:max_value] for k, v in {**params, **(self.trial_params or {})}.items() if len(k) <= max_key
        }
        if not self.owns_run or self.continue_run_id:  # an existing run: MLflow params are write-once
            existing = self.client.get_run(run_id).data.params
            values = {k: v for k, v in values.items() if k not in existing}
        items = [Param(k, v) for k, v in values.items()]
        for i in range(0, len(items), per_batch):
            self.client.log_batch(run_id, params=items[i : i + per_batch])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        run_id = self._start()
        _, _, per_batch, _ = _limits()
        now = int(time.time() * 1000)
        items = [Metric(metric_key(k), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), per_batch):
            self.client.log_batch(run_id, metrics=items[i : i + per_batch])

    def log_artifact(self, path: str) -> None:
        run_id = self._start()
        if os.path.isdir(path):
            self.client.log_artifacts(run_id, path, artifact_path=os.path.basename(os.path.normpath(path)))
        else:
            self.client.log_artifact(run_id, path)

    def finalize(self, status: str) -> None:
        if self.live and self.owns_run:
            self.client.set_terminated(self.run_id, _STATUS.get(status, "FAILED"))
        self.live = False
