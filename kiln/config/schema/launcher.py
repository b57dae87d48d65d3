"""`launcher`: what starts the processes when `kiln fit` runs a config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from kiln.config.schema.fields import opt


@dataclass
class LauncherConfig:
    """What starts the processes when `kiln fit` runs this config (the command line's `--nproc` / `--ray`
    do the same without a config key). Empty: this process trains, or the launcher that started it
    (torchrun, srun, accelerate launch) decides."""

    name: Optional[str] = opt(
        None, "ray: train in Ray Train workers (a TorchTrainer); unset: no launcher of kiln's own."
    )
    num_workers: int = opt(1, "ray: the number of training workers (processes), like --nproc.")
    resources_per_worker: Dict[str, Any] = opt(
        {},
        "ray: Ray resources each worker asks for, e.g. {CPU: 2} or {GPU: 1} (a GPU makes Ray use NCCL); default 1 CPU.",
    )
    address: Optional[str] = opt(
        None,
        "ray: the cluster to join ('auto', or ray://host:port); unset: start a local Ray "
        "instance on this machine for this run.",
    )
    max_failures: int = opt(
        0,
        "ray: restart the workers up to this many times when one fails (Ray's FailureConfig); each "
        "restart resumes from the newest checkpoint reported to Ray.",
    )
    storage_path: Optional[str] = opt(
        None, "ray: where Ray keeps its copies of the checkpoints and the run's state (default output_dir/ray_results)."
    )
    num_to_keep: Optional[int] = opt(
        None, "ray: checkpoints Ray keeps in storage_path (CheckpointConfig.num_to_keep); unset: all."
    )
    checkpoint_score_attribute: Optional[str] = opt(
        None,
        "ray: the reported metric (e.g. eval_loss) that ranks checkpoints for num_to_keep and Result.best_checkpoints; "
        "unset: the newest are kept.",
    )
    checkpoint_score_order: str = opt("min", "ray: min or max: which checkpoint_score_attribute value is best.")
