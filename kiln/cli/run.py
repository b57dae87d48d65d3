"""One command in this process (`kiln fit|evaluate|predict` once any launcher has started the processes):
the config loaded with the launcher's settings, the task built, then fit or score; an error ends it as one
line and an exit code (kiln/cli/errors.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.cli import errors

if TYPE_CHECKING:
    from kiln.launch.settings import LauncherSetting


def run_command(
    command: str,
    config: str,
    overrides: list[str],
    weights: str | None = None,
    random_weights: bool = False,
    launcher: list[LauncherSetting] | None = None,
    show_traceback: bool = False,
) -> int:
    """`command` ("fit", "evaluate" or "predict") on `config` with `overrides`; the process's exit code."""
    from kiln.cli.fit import fit
    from kiln.cli.score import pick_weights, score
    from kiln.cli.task import build_trainer
    from kiln.launch.environment import detect
    from kiln.launch.settings import load_with_launcher_settings

    try:
        if command != "fit":  # scoring weights must not touch the training run's history files or trackers
            overrides = [*overrides, "log.history=[]", "log.report_to=none"]
        cfg = load_with_launcher_settings(config, overrides, launcher)  # a launcher fills keys the config leaves unset
        chosen = None if command == "fit" else pick_weights(cfg, weights, random_weights)
        trainer, data = build_trainer(cfg)
        if command == "fit" and detect().source == "ray":  # a Ray Train worker: Ray keeps and restores the checkpoints
            from kiln.engine.callbacks.ray_report import RayReportCallback

            trainer.add_callback(RayReportCallback())
        # the Trainer is torn down when the process exits (Trainer.teardown's fallback): a process running
        # several commands (the tests) keeps one process group, as torch cannot meet twice at one env:// address
        if command == "fit":
            fit(trainer, data)
        else:
            score(command, trainer, data, chosen)
    except KeyboardInterrupt as err:
        return errors.interrupted(err)
    except Exception as err:  # noqa: BLE001 - user code kiln calls can raise anything: one line, unless --traceback
        if errors.by_peer_interrupt(err):
            return errors.interrupted()
        if show_traceback:
            raise
        return errors.failed(err)
    return 0
