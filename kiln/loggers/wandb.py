"""Weights & Biases: one run with the flattened config, every metric against `train/global_step`
(HF's layout: `train/loss`, `eval/loss`), and checkpoints as artifacts when asked.

Never prompts: W&B's own settings are honoured (`WANDB_MODE=offline`, `WANDB_PROJECT`, `WANDB_RUN_ID`
with `WANDB_RESUME`, ...), and where no API key is configured (neither `WANDB_API_KEY` nor a `wandb login`
entry in ~/.netrc) the run is written offline with a warning instead of asking for an account. Runs
live under `<output_dir>/wandb/`; `wandb sync <folder>` uploads an offline run later. A run the caller
already started with `wandb.init()` receives the logs and stays open."""

from __future__ import annotations

import logging
import netrc
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from kiln.loggers import LOGGERS
from kiln.loggers.base import Logger, grouped_name, require, run_name, setting

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

STEP = "train/global_step"


def has_credentials() -> bool:
    """Whether W&B can log in without asking: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


@LOGGERS.register("wandb")
class WandbLogger(Logger):
    name = "wandb"
    package = "wandb"

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        require("wandb", "wandb", "report_to: wandb")
        self.output_dir = os.path.abspath(str(config.output_dir))
        self.project: str = setting(config, "project", "WANDB_PROJECT", "kiln")
        self.run: Any | None = None
        self.run_id: str | None = None  # kept after finalize, so later logs continue the run
        self.owns_run = False
        self.params: dict[str, Any] = {}

    def _start(self) -> Any:
        if self.run is not None:
            return self.run
        import wandb

        if wandb.run is not None and not self.trial_name:
            self.run, self.owns_run = wandb.run, False
        else:
            kwargs: dict[str, Any] = dict(
                project=self.project,
                name=self.trial_name or run_name(self.config),
                dir=self.output_dir,
                config=self.params or None,
            )
            if self.trial_name:  # HF: trials are runs grouped under the search's run name
                kwargs.update(group=run_name(self.config), reinit="create_new")
            if self.run_id:
                kwargs.update(id=self.run_id, resume="allow")
            mode = (os.environ.get("WANDB_MODE") or "").lower()
            if mode in ("offline", "disabled", "dryrun"):
                # passed explicitly: wandb reads the environment once per process, so a later change is missed
                kwargs["mode"] = "offline" if mode == "dryrun" else mode
            elif not has_credentials():
                log.warning(
                    "W&B has no API key here (set WANDB_API_KEY or run `wandb login`); logging offline "
                    "under %s/wandb. Upload later with `wandb sync`.",
                    self.output_dir,
                )
                kwargs["mode"] = "offline"
            os.makedirs(self.output_dir, exist_ok=True)
            self.run, self.owns_run = wandb.init(**kwargs), True
            self.run_id = self.run.id
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP, step_sync=True)
        return self.run

    def set_trial(self, name: str | None, params: Mapping[str, Any] | None) -> None:
        if name != self.trial_name:
            self.finalize("success")
            self.run_id = None
        super().set_trial(name, params)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.params = {**params, **(self.trial_params or {})}
        fresh = self.run is None and self.run_id is None
        run = self._start()  # a new run gets the config from wandb.init
        if not (fresh and self.owns_run):
            run.config.update(self.params, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._start().log({**{grouped_name(k): v for k, v in metrics.items()}, STEP: step})

    def log_artifact(self, path: str) -> None:
        import wandb

        run = self._start()
        artifact = wandb.Artifact(name=f"model-{run.id}", type="model")
        if os.path.isdir(path):
            artifact.add_dir(path)
        else:
            artifact.add_file(path)
        run.log_artifact(artifact, aliases=[os.path.basename(os.path.normpath(path))])

    def finalize(self, status: str) -> None:
        if self.run is not None and self.owns_run:
            self.run.finish(exit_code=0 if status == "success" else 1)
        self.run = None
