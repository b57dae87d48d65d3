"""`log`: logging, progress and trackers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from kiln.config.schema.fields import opt


@dataclass
class LogConfig:
    """Logging, progress and trackers."""

    strategy: str = opt("steps", "When to log: no, steps or epoch.")
    steps: float = opt(500, "Steps between logs (int, or a ratio < 1 of total steps).")
    first_step: bool = opt(False, "Also log the first optimizer step.")
    nan_inf_filter: bool = opt(
        True,
        "Replace a nan/inf step loss by the window's mean in the logs, and leave nan/inf "
        "batches out of eval_loss (HF's logging_nan_inf_filter); see nonfinite_window for a "
        "window without a finite loss.",
    )
    nonfinite_window: Optional[str] = opt(
        None,
        "The logged loss of a window whose every step had a nan/inf loss, and train_loss of a run without a finite "
        "one, under nan_inf_filter: 'nan' (kiln: there is no finite loss to stand in with) or 'filtered' (HF: the "
        "filter's stand-in, 0.0). Unset: 'filtered' when the config comes in HF's dialect (see "
        "train.max_nonfinite_steps), else 'nan'.",
    )
    report_to: List[str] = opt(
        ["none"],
        "Trackers: tensorboard, mlflow, wandb, comet_ml, clearml, dvclive, aim, trackio, "
        "swanlab, codecarbon, neptune, csv, jsonl, all or none.",
    )
    logging_dir: Optional[str] = opt(
        None,
        "Run files (metrics.csv/jsonl; default output_dir/runs) and TensorBoard events (default output_dir/runs/<date>_<host>).",
    )
    level: str = opt("passive", "Log level on the main process: debug, info, warning, error, critical, passive.")
    level_replica: str = opt("warning", "Log level on the other processes.")
    on_each_node: bool = opt(True, "Apply `level` on each node's main process, not only node 0.")
    disable_tqdm: Optional[bool] = opt(None, "Disable the progress bar.")
    model_summary: str = opt(
        "auto",
        "What fit prints about the model when it starts, on the main process: table (a line, "
        "then Lightning's ModelSummary table: name, type, parameters, trainable, size per module), "
        "line, off, or auto: the table on one process, the line with several.",
    )
    model_summary_depth: int = opt(
        1,
        "Module depth of the summary table's rows (Lightning's max_depth): 1 the model's "
        "top-level modules, 2 their children too, -1 every module.",
    )
    skip_memory_metrics: bool = opt(True, "Skip memory metrics (they slow training).")
    include_tokens_per_second: bool = opt(False, "Report tokens per second.")
    mfu_peak_tflops: Optional[float] = opt(
        None,
        "Peak TFLOP/s of one device, for the logged mfu; unset: the table's figure for the GPU and precision "
        "(H100, H200, A100, L4, MI300), none on the CPU.",
    )
    history: Optional[List[str]] = opt(
        None,
        "Local history files (csv, jsonl) written to logging_dir, default output_dir/runs. "
        "Unset: csv and jsonl, except with report_to none (HF's default), which writes "
        "nothing there, as HF does; [] for none.",
    )
    project: Optional[str] = opt(
        None,
        "Tracker project: W&B, Comet, ClearML, Trackio, SwanLab project, MLflow or Aim "
        "experiment (default WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME / COMET_PROJECT_NAME / "
        "CLEARML_PROJECT, then 'kiln').",
    )
    log_artifacts: Optional[str] = opt(
        None,
        "Upload the model to trackers: false, end or checkpoint (default HF_MLFLOW_LOG_ARTIFACTS / WANDB_LOG_MODEL).",
    )
    nested_run: Optional[bool] = opt(
        None, "MLflow: open the run as a child of the caller's active run (default MLFLOW_NESTED_RUN)."
    )
