"""`task.data` for the elastic-restart tests (`kiln fit --nproc 2 --max-restarts K`, `torchrun
--max-restarts K`): the CLI runs' data plus a callback that SIGKILLs its own process at given global
steps of given attempts, as an out-of-memory kill or a lost machine would, and records where each
attempt started. The attempt number is read through kiln/launch (the launcher's restart count)."""

from __future__ import annotations

import os
import signal
from typing import Any

from kiln import Callback
from kiln.launch.environment import detect
from tests.distributed.toy import cli_data


class KillOnAttempt(Callback):
    """`kills`: "attempt:rank:step" strings. At the end of `step` of that attempt, rank `rank` writes
    `<folder>/killed-<attempt>` and kills itself with SIGKILL (no teardown, no save, no report).
    On train begin, global rank 0 writes the step it starts from to `<folder>/start-<attempt>`."""

    def __init__(self, folder: str, kills: list[str]) -> None:
        self.folder = folder
        self.kills = [tuple(int(part) for part in kill.split(":")) for kill in kills]
        self.env = detect()

    def _write(self, name: str, text: str) -> None:
        tmp = os.path.join(self.folder, f".{name}")
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, os.path.join(self.folder, name))

    def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.env.rank == 0:
            self._write(f"start-{self.env.restart_count}", str(state.global_step))
            with open(os.path.join(self.folder, "starts"), "a") as fh:  # every attempt, whatever its number
                fh.write(f"{state.global_step}\n")

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if (self.env.restart_count, self.env.rank, state.global_step) in self.kills:
            self._write(f"killed-{self.env.restart_count}", f"{self.env.rank}:{state.global_step}")
            os.kill(os.getpid(), signal.SIGKILL)


class KillOnce(KillOnAttempt):
    """`kills`: "rank:step" strings; each kill happens once, on whichever attempt first gets there (on
    several nodes each agent counts its own restarts, so attempt numbers need not agree)."""

    def __init__(self, folder: str, kills: list[str]) -> None:
        super().__init__(folder, [f"0:{kill}" for kill in kills])

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        name = f"killed-{self.env.rank}-{state.global_step}"
        if (0, self.env.rank, state.global_step) in self.kills and not os.path.exists(os.path.join(self.folder, name)):
            self._write(name, "")
            os.kill(os.getpid(), signal.SIGKILL)


def data(folder: str = "", kills: Any = (), once: Any = ()) -> dict[str, Any]:
    out = cli_data()
    if kills:
        out["callbacks"].append(KillOnAttempt(folder, list(kills)))
    if once:
        out["callbacks"].append(KillOnce(folder, list(once)))
    return out
