"""`task.data` for the Ray Train tests (tests/launch/test_ray_*.py): the CLI runs' regression data plus
a callback that ends one worker abruptly (`os._exit`, as a lost machine would) at a chosen step of the
first attempt only (a marker file remembers the kill), and records the step each attempt starts from; and
the tests' `kiln fit` config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kiln import Callback
from kiln.launch.environment import detect
from tests.distributed.toy import cli_data, regression_data


class DieOnce(Callback):
    """Global rank `rank` exits at the end of step `step`, once (`<folder>/killed` marks it done);
    global rank 0 appends the step each attempt starts from to `<folder>/starts`."""

    def __init__(self, folder: str, rank: int, step: int) -> None:
        self.folder, self.rank, self.step = folder, rank, step
        self.env = detect()

    def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.env.rank == 0:
            with open(os.path.join(self.folder, "starts"), "a") as fh:
                fh.write(f"{self.env.source}:{self.env.world_size}:{state.global_step}\n")

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        marker = os.path.join(self.folder, "killed")
        if self.env.rank == self.rank and state.global_step == self.step and not os.path.exists(marker):
            import ray.train

            # Ray registers a report a moment after the workers made it: wait for that, so that the
            # checkpoint Ray hands back is the newest one (an earlier one would resume exactly too)
            ray.train.get_all_reported_checkpoints(ray.train.CheckpointConsistencyMode.COMMITTED)
            with open(marker, "w") as fh:
                fh.write(f"{self.rank}:{self.step}")
            os._exit(1)


def data(folder: str = "", die_rank: int = -1, die_step: int = 0, eval_rows: int = 0) -> dict[str, Any]:
    out = cli_data()
    if eval_rows:  # evaluated once after training (the CLI's final evaluation): the weights are those without it
        out["eval_dataset"] = regression_data(eval_rows, seed=1)
    if folder:
        out["callbacks"] = [*out["callbacks"], DieOnce(folder, die_rank, die_step)]
    return out


MAX_STEPS, SAVE_STEPS = 6, 2
#: the step at the end of which rank 1 of the restarted Ray run's first attempt dies (tests/launch/conftest.py)
DIE_STEP = 5


def write_config(path: Path, output_dir: Path, **data_args: Any) -> str:
    """A `kiln fit` config over the CLI runs' model and this module's `data` (its arguments: data_args)."""
    cfg = {
        "output_dir": str(output_dir),
        "seed": 5,
        "learning_rate": 1e-2,
        "max_steps": MAX_STEPS,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "save_steps": SAVE_STEPS,
        "logging_steps": 1,
        "disable_tqdm": True,
        "report_to": "none",
        "strategy": {"name": "auto", "device": "cpu", "timeout": 60},
        "task": {
            "model": "tests.distributed.toy:cli_model",
            "model_args": {"dropout": 0.0},
            "data": "tests.launch.ray_toy:data",
            "data_args": data_args,
        },
    }
    OmegaConf.save(OmegaConf.create(cfg), path)
    return str(path)
