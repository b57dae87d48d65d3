"""The typed config tree: `TrainingConfig`, the root, and one module per section below it (`train`, `data`,
`optim`, `evaluation`, `save`, `log`, `strategy`, `precision`, `task`, `launcher`, `profiling`). Every group is a
dataclass whose fields carry a `help` text; the CLI's `--help` and docs/config.md are generated from these.
Defaults follow Hugging Face `TrainingArguments` so that an HF user's numbers mean the same thing here.

OmegaConf reads these annotations at run time: keep Optional[...] / List / Dict (2.3 does not read `X | None`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kiln.config.schema.data import DataConfig
from kiln.config.schema.evaluation import EvalConfig
from kiln.config.schema.fields import opt
from kiln.config.schema.launcher import LauncherConfig
from kiln.config.schema.log import LogConfig
from kiln.config.schema.optim import OptimConfig, SchedulerConfig
from kiln.config.schema.precision import PrecisionConfig
from kiln.config.schema.profiling import MemorySnapshotConfig, ProfileConfig
from kiln.config.schema.save import SaveConfig
from kiln.config.schema.strategy import StrategyConfig
from kiln.config.schema.task import TaskConfig
from kiln.config.schema.train import ActivationCheckpointingConfig, TorchCompileConfig, TrainConfig


@dataclass
class TrainingConfig:
    """The whole run. Flat Hugging Face TrainingArguments names are accepted too (see kiln.config.hf.aliases)."""

    output_dir: str = opt(
        "tmp_trainer",
        "Where checkpoints, logs and the final model go: a folder, or an fsspec URL (s3://bucket/run, gs://..., "
        "memory://...; file:// is a local folder) whose checkpoints and final model are written in save.staging_dir "
        "and uploaded (save.remote_dir).",
    )
    overwrite_output_dir: bool = opt(False, "Allow writing into an output_dir that holds checkpoints without resuming.")
    run_name: Optional[str] = opt(None, "Run name for trackers (default output_dir).")
    seed: int = opt(42, "Seed set before the model is built and before training.")
    data_seed: Optional[int] = opt(None, "Seed for data sampling (default seed).")
    full_determinism: bool = opt(False, "Deterministic algorithms everywhere (slow; for debugging).")
    resume_from_checkpoint: Optional[str] = opt(
        None,
        "A checkpoint path, or 'true' for the newest complete one in output_dir (an error when there is none, as "
        "in HF), or 'if_exists': the newest one if there is one, else start fresh (restarted and pre-empted jobs).",
    )
    train: TrainConfig = field(default_factory=TrainConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    torch_compile: TorchCompileConfig = field(default_factory=TorchCompileConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    log: LogConfig = field(default_factory=LogConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    memory_snapshot: MemorySnapshotConfig = field(default_factory=MemorySnapshotConfig)
