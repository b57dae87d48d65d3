"""`profile:` torch.profiler over chosen optimizer steps, one trace per rank.

The profiler starts with training and advances once per optimizer step (`on_step_end`), so its schedule
counts optimizer steps: `skip_first`, then `repeat` cycles of `wait` + `warmup` + `active` steps, as
torch.profiler.schedule counts them. Each active span is written when it ends, by torch's TensorBoard
trace handler, to `<output_trace_dir>/rank<R>/rank<R>.<time>.pt.trace.json`: TensorBoard's profiler
plugin reads the folder, and chrome://tracing or Perfetto open the file. accelerate's ProfileKwargs names
(`schedule_option`, `output_trace_dir`, `activities`, `with_flops`, ...) are the config's own, so an
accelerate user's settings carry over.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState

SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")
ACTIVITIES = ("cpu", "cuda", "xpu")


def profile_schedule(profile: Any) -> dict[str, int]:
    """The schedule's five counts: the `profile:` keys, with accelerate's `schedule_option` over them."""
    schedule = {key: int(profile[key]) for key in SCHEDULE_KEYS}
    option: Mapping[str, Any] = profile.schedule_option or {}
    unknown = sorted(set(option) - set(SCHEDULE_KEYS))
    if unknown:
        raise ConfigError(
            f"profile.schedule_option has unknown key(s) {unknown}; it takes {list(SCHEDULE_KEYS)} "
            "(accelerate's ProfileKwargs.schedule_option)."
        )
    schedule.update({key: int(value) for key, value in option.items()})
    negative = [key for key, value in schedule.items() if value < 0]
    if negative:
        raise ConfigError(f"profile.{negative[0]} is {schedule[negative[0]]}; step counts cannot be negative.")
    return schedule


def profiler_callback(config: Any, global_rank: int, device_type: str) -> ProfilerCallback | None:
    """The callback `profile:` asks for on this rank, or None (profiling off, or another rank's job)."""
    profile = config.profile
    schedule = profile_schedule(profile)
    if schedule["active"] == 0:
        return None
    activities = (
        list(profile.activities)
        if profile.activities
        else ["cpu"] + ([device_type] if device_type in ACTIVITIES[1:] else [])
    )
    unknown = [a for a in activities if a not in ACTIVITIES]
    if unknown:
        raise ConfigError(f"profile.activities names {unknown}; use any of {list(ACTIVITIES)}.")
    if profile.ranks is not None and global_rank not in list(profile.ranks):
        return None
    folder = os.path.join(profile.output_trace_dir or os.path.join(config.output_dir, "profiles"), f"rank{global_rank}")
    return ProfilerCallback(
        schedule,
        activities,
        folder,
        f"rank{global_rank}",
        {
            key: bool(profile[key])
            for key in ("record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules")
        },
    )


class ProfilerCallback(Callback):
    reads_checkpoint_on_save = False

    def __init__(
        self, schedule: dict[str, int], activities: list[str], folder: str, worker_name: str, options: dict[str, bool]
    ) -> None:
        self.schedule, self.activities, self.folder = schedule, activities, folder
        self.worker_name, self.options = worker_name, options
        self.profiler: Any = None

    def on_train_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        import torch.profiler as tp

        kinds = {"cpu": tp.ProfilerActivity.CPU, "cuda": tp.ProfilerActivity.CUDA, "xpu": tp.ProfilerActivity.XPU}
        self.profiler = tp.profile(
            activities=[kinds[a] for a in self.activities],
            schedule=tp.schedule(**self.schedule),
            on_trace_ready=tp.tensorboard_trace_handler(self.folder, worker_name=self.worker_name),
            record_shapes=self.options["record_shapes"],
            profile_memory=self.options["profile_memory"],
            with_stack=self.options["with_stack"],
            with_flops=self.options["with_flops"],
            with_modules=self.options["with_modules"],
        )
        self.profiler.start()

    def on_step_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if self.profiler is not None:  # an active span cut short by the end of training is written too
            self.profiler.stop()
            self.profiler = None
