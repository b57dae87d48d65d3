"""Where this process sits in the job, as the launcher told it. Each launcher or scheduler is a
small `ClusterKind` that recognises its own variables (one module each); `detect()` asks them in the
order of `KINDS` and returns the first one's reading as a `ClusterEnvironment`, which is all the
rest of kiln sees (never an environment read). A new kind is one module plus one `register` call.

Precedence: Ray Train (its workers carry torchrun's and accelerate's variables too), accelerate (its
settings ride on torchrun's topology), the deepspeed launcher, torchrun
(so `torchrun` inside an `sbatch` allocation is read as torchrun), SLURM's srun, then no launcher.
What a launcher asks of the run's *settings* is `kiln/launch/settings.py`."""

from __future__ import annotations

from dataclasses import replace

from kiln.launch.environment.accelerate import Accelerate
from kiln.launch.environment.base import ClusterEnvironment, ClusterKind, Env, current, restart_count, visible_devices
from kiln.launch.environment.deepspeed import DeepSpeedLauncher
from kiln.launch.environment.none import NoLauncher
from kiln.launch.environment.ray import RayTrain
from kiln.launch.environment.slurm import Slurm
from kiln.launch.environment.torchrun import Torchrun, attempt_store

__all__ = ["KINDS", "ClusterEnvironment", "ClusterKind", "attempt_store", "detect", "register", "visible_devices"]

#: asked in this order; the last one (no launcher) detects every environment
KINDS: list[type[ClusterKind]] = [Accelerate, DeepSpeedLauncher, Torchrun, Slurm, NoLauncher]


def register(kind: type[ClusterKind], before: type[ClusterKind] | None = None) -> None:
    """Add a cluster kind, asked just before `before` (default: before "no launcher", i.e. after
    every built-in one). Registering a kind again moves it."""
    if kind in KINDS:
        KINDS.remove(kind)
    KINDS.insert(KINDS.index(before if before is not None else NoLauncher), kind)


def detect(env: Env | None = None) -> ClusterEnvironment:
    """Read the process topology from the environment a launcher set up (`env` defaults to
    `os.environ`): the reading of the first kind in `KINDS` that recognises it."""
    env = current(env)
    reading = next(kind for kind in KINDS if kind.detects(env)).read(env)
    # whoever restarted the job, not only the kind that reads the topology (torchrun inside a requeued SLURM job)
    return replace(reading, restart_count=restart_count(env)) if not reading.restart_count else reading


register(RayTrain, before=Accelerate)
