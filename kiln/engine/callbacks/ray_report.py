"""Hands every kiln checkpoint to Ray Train, so that Ray's `CheckpointConfig` (num_to_keep, the score
attribute), `Result.checkpoint` and a restart after a failure (`FailureConfig`) work on kiln's own
checkpoints. `kiln fit --ray N` (and config `launcher: {name: ray}`) adds it; under your own
`TorchTrainer`, add it yourself: `Trainer(..., callbacks=[RayReportCallback()])`.

Ray asks every worker to call `ray.train.report` the same number of times (it is a barrier), so every
rank reports at each save; global rank 0 alone hands over the folder, because every kiln checkpoint
is one folder that rank 0 seals with its COMPLETE marker once all ranks wrote their part. Ray copies
the folder into its storage under the same name (`checkpoint-<step>`); the marker's file list is
relative, so the copy is as complete as the original and kiln resumes from it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState


def step_metrics(state: TrainerState) -> dict[str, Any]:
    """What the run logged at this step (training loss, learning rate, evaluation metrics), plus `step`
    and `epoch`: the metrics reported to Ray with the step's checkpoint."""
    metrics: dict[str, Any] = {}
    for entry in state.log_history:
        if entry.get("step") == state.global_step:
            metrics.update({k: v for k, v in entry.items() if isinstance(v, (int, float))})
    metrics.update(step=state.global_step, epoch=state.epoch)
    return metrics


class RayReportCallback(Callback):
    """`ray.train.report(metrics, checkpoint=...)` after each checkpoint kiln writes."""

    def __init__(self) -> None:
        from kiln.launch.ray import require_ray

        require_ray("RayReportCallback")
        self.reported: list[int] = []  # the steps handed to Ray, in order (for tests and logs)

    def on_save(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        import ray.train

        folder = self._folder(config, state)
        # Ray's copy is its own: kiln's rotation (save.total_limit) keeps deleting the folders in output_dir
        checkpoint = ray.train.Checkpoint.from_directory(folder) if folder is not None else None
        ray.train.report(
            step_metrics(state),
            checkpoint=checkpoint,
            checkpoint_dir_name=os.path.basename(folder) if folder else None,
            delete_local_checkpoint_after_upload=False,
        )
        self.reported.append(state.global_step)

    @staticmethod
    def _folder(config: DictConfig, state: TrainerState) -> str | None:
        """This step's complete checkpoint folder on global rank 0; None elsewhere, or where the save was
        declined (save.strategy: best without a better metric)."""
        from kiln.engine.checkpoint.files import PREFIX, is_complete

        if not state.is_world_process_zero:
            return None
        path = os.path.abspath(os.path.join(str(config.output_dir), f"{PREFIX}{state.global_step}"))
        return path if is_complete(path) else None
