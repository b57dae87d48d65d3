"""`kiln fit`: the run in this process, and what `--profile` adds to its overrides."""

from __future__ import annotations

from typing import Any

#: optimizer steps `kiln fit --profile` records
PROFILE_STEPS = 3


def fit(trainer: Any, data: dict[str, Any]) -> None:
    """`kiln fit` in this process: train, then evaluate (with eval data), export the model and save the state."""
    import os

    from kiln.engine.checkpoint.output_dir import run_lock

    cfg = trainer.config
    where = os.path.abspath(cfg.output_dir)
    if cfg.save.remote_dir:  # an output_dir URL: written locally, uploaded
        where = f"{cfg.save.remote_dir} (staged in {where})"
    say = trainer.is_world_process_zero() and cfg.log.level not in ("error", "critical")  # as the model summary
    if say:
        print(f"kiln: output_dir {where}", flush=True)
    with run_lock(cfg, trainer.strategy):  # fit takes it too: held here until the export is written
        result = trainer.fit()
        if trainer.checkpoints.preempted_step is not None:  # SIGTERM: its checkpoint is written; leave now, exit 0
            return
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        if data.get("eval_dataset") is not None:
            metrics = trainer.evaluate()
            trainer.log_metrics("eval", metrics)
            trainer.save_metrics("eval", metrics)
        trainer.save_model()
        trainer.save_state()
    if say:
        print(f"kiln: done; the run's files are in {where}", flush=True)


def profile_overrides(config: str, overrides: list[str]) -> list[str]:
    """`kiln fit --profile`: record 3 optimizer steps (wait and warmup keep their defaults), unless the
    config file or a `key=value` already sets `profile.active`, which then wins."""
    from kiln.launch.settings import explicit_keys

    given = explicit_keys(config, [o for o in overrides if o != "--traceback"])
    return [] if "profile.active" in given else [f"profile.active={PROFILE_STEPS}"]
