"""`kiln fit --ray N CONFIG ...` and config `launcher: {name: ray, ...}`: kiln's fit in the workers of
Ray Train's `TorchTrainer`, on a local Ray instance started for the run (no `address`) or on the
cluster named by `address` (`auto`: the one `ray start` joined this machine to).

Each worker runs the same command `kiln fit --nproc N` gives its processes: the CLI hands its own
per-worker function (`kiln.cli.train_loop_per_worker`) to `launch_ray`, because this package sits
below the CLI and the engine and so never names them. Ray has made the process group by then and exported the topology; the
cluster kind `kiln.launch.environment.ray` reads it, and the strategies use Ray's group. The CLI adds
`kiln.engine.callbacks.ray_report.RayReportCallback` under Ray, so each kiln checkpoint is reported
to Ray with the step's metrics; when Ray restarts the workers after a failure (`max_failures`), they
resume from the checkpoint Ray hands back (`ray.train.get_checkpoint()`), exactly.

Ray is imported only here, when a Ray run starts; `pip install 'kiln[ray]'` provides it."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.utils.errors import KilnError

#: the one sentence's fix for a missing Ray
INSTALL = "pip install 'kiln[ray]'"


#: Ray Train's workers replace `print` with one that logs each line and also prints it when `sys.stdout` is not
#: `sys.__stdout__`, which Ray's own worker stdout never is: every line kiln prints would reach the driver twice
#: (once on stdout, once on stderr). kiln's workers print as plain processes do; Ray still forwards their output.
WORKER_RUNTIME_ENV = {"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}


class RayMissingError(KilnError, ImportError):
    """Ray (with Ray Train and Tune) is not installed."""


def require_ray(what: str) -> None:
    """Fail with one sentence naming the extra when Ray is missing (`what` names the feature)."""
    if importlib.util.find_spec("ray") is None:
        raise RayMissingError(f"{what} needs Ray Train, which is not installed: {INSTALL}")


@dataclass(frozen=True)
class RayLaunch:
    """How the Ray run is started: the config's `launcher` keys (see their help in kiln.config.schema.launcher)."""

    num_workers: int = 1
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    address: str | None = None
    max_failures: int = 0
    storage_path: str | None = None
    name: str = "kiln"
    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "min"

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise KilnError(f"Ray needs at least one worker: num_workers (--ray) is {self.num_workers}.")
        if self.max_failures < 0:
            raise KilnError(f"launcher.max_failures (--max-restarts) must be >= 0, got {self.max_failures}.")
        if self.checkpoint_score_order not in ("min", "max"):
            raise KilnError(f"launcher.checkpoint_score_order must be min or max, got {self.checkpoint_score_order!r}.")
        bad = {
            k: v
            for k, v in self.resources_per_worker.items()
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
        }
        if bad:
            raise KilnError(
                f"launcher.resources_per_worker takes amounts per resource name (e.g. {{CPU: 2, GPU: 1}}); "
                f"{bad} is not one."
            )

    @classmethod
    def from_config(cls, cfg: Any, num_workers: int | None = None, max_failures: int | None = None) -> RayLaunch:
        """From a loaded kiln config; `num_workers` / `max_failures` (the command line's --ray N /
        --max-restarts K) win over its `launcher` keys. Ray keeps its files in output_dir/ray_results
        unless `launcher.storage_path` says otherwise."""
        from omegaconf import OmegaConf

        launcher = cfg.launcher
        if launcher.name not in (None, "ray"):
            raise KilnError(
                f"launcher.name {launcher.name!r} is not a launcher kiln starts; use launcher.name=ray, or "
                "leave it unset (torchrun, srun, accelerate launch and `kiln fit --nproc` need no key)."
            )
        output_dir = os.path.abspath(str(cfg.output_dir))
        return cls(
            num_workers=int(num_workers if num_workers is not None else launcher.num_workers),
            resources_per_worker=dict(OmegaConf.to_container(launcher.resources_per_worker)),  # type: ignore[arg-type]
            address=launcher.address,
            max_failures=int(max_failures if max_failures else launcher.max_failures),
            storage_path=os.path.abspath(launcher.storage_path or os.path.join(output_dir, "ray_results")),
            name=str(cfg.run_name or os.path.basename(output_dir) or "kiln"),
            num_to_keep=launcher.num_to_keep,
            checkpoint_score_attribute=launcher.checkpoint_score_attribute,
            checkpoint_score_order=str(launcher.checkpoint_score_order),
        )


def launch_ray(
    argv: Sequence[str], launch: RayLaunch, train_loop: Callable[[dict[str, Any]], None], cwd: str | None = None
) -> Any:
    """Run `train_loop` (`kiln fit <argv>`: kiln.cli.train_loop_per_worker) in `launch.num_workers` Ray Train
    workers; returns Ray's `Result` (its
    `checkpoint` is the last kiln checkpoint reported). `cwd`: where the workers resolve relative
    paths (default this process's working directory, as `kiln fit --nproc`; Ray would use its own)."""
    require_ray("kiln fit --ray")
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = _start(launch)
    try:
        resources = dict(launch.resources_per_worker)
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"argv": list(argv), "cwd": os.path.abspath(cwd or os.getcwd())},
            scaling_config=ScalingConfig(
                num_workers=launch.num_workers,
                use_gpu=resources.get("GPU", 0) > 0,
                resources_per_worker=resources or None,
            ),
            run_config=RunConfig(
                name=launch.name,
                storage_path=launch.storage_path,
                worker_runtime_env=WORKER_RUNTIME_ENV,  # type: ignore[call-arg]  # ray.train exports Train v2's RunConfig (which has it) when v2 is enabled at import; mypy sees v1's
                failure_config=FailureConfig(max_failures=launch.max_failures),
                checkpoint_config=CheckpointConfig(
                    num_to_keep=launch.num_to_keep,
                    checkpoint_score_attribute=launch.checkpoint_score_attribute,
                    checkpoint_score_order=launch.checkpoint_score_order,
                ),
            ),
        )
        return trainer.fit()
    finally:
        if started:
            ray.shutdown()


def _start(launch: RayLaunch) -> bool:
    """Connect to the cluster at `launch.address`, or start a local Ray instance sized for the workers;
    True when this call started (and so must stop) it. A Ray the caller started is used as it is."""
    import ray

    if ray.is_initialized():
        return False
    if launch.address:
        ray.init(address=launch.address)
        return True
    cpus = launch.resources_per_worker.get("CPU", 1) * launch.num_workers
    # a local instance for this run only, without the dashboard, with at least the CPUs the workers ask for
    ray.init(num_cpus=max(math.ceil(cpus), os.cpu_count() or 1), include_dashboard=False)
    return True


def run_worker(config: dict[str, Any], fit: Callable[[list[str]], int]) -> None:
    """The body of Ray Train's per-worker function: `fit(argv)` (`kiln fit` with `config["argv"]`, the
    config file and its overrides) in this worker, in `config["cwd"]` when given. A worker of a restarted
    group resumes from the checkpoint Ray hands back. A non-zero exit code of `fit` fails the worker."""
    import ray.train

    cwd = config.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    argv = list(config["argv"])
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        _fit(fit, argv)
        return
    with checkpoint.as_directory() as folder:  # the folder itself on local storage, a download otherwise
        _fit(fit, [*argv, f"resume_from_checkpoint={folder}"])


def _fit(fit: Callable[[list[str]], int], argv: list[str]) -> None:
    code = fit(argv)
    if code:
        raise RuntimeError(f"kiln fit exited with code {code} in this Ray worker (its message is above).")


def fit_with_ray(
    command: str,
    config: str,
    overrides: Sequence[str],
    num_workers: int | None,
    other_launcher: bool,
    max_restarts: int,
    *,
    train_loop: Callable[[dict[str, Any]], None],
) -> int | None:
    """The CLI's `kiln fit --ray N` / `launcher.name: ray`: the run in Ray Train workers (each running
    `train_loop`), and its exit code; None when this process trains itself (no Ray asked for, or this is
    one of Ray's workers)."""
    import sys

    from kiln.config.load import load_config
    from kiln.launch.environment import detect

    if command != "fit":  # evaluate / predict ignore the launcher key, and refuse the flag
        if num_workers is None:
            return None
        print(
            f"kiln: error: --ray starts training workers; kiln {command} runs in this process (drop --ray).",
            file=sys.stderr,
        )
        return 2
    plain = [o for o in overrides if o != "--traceback"]
    # a config is loaded here only when it can ask for Ray (its text names the key): `kiln fit` stays as fast
    if num_workers is None and not _mentions_launcher(config, plain):
        return None
    if detect().source == "ray":  # one of Ray's workers, running this very command
        return None
    try:
        cfg = load_config(config, plain)
        if num_workers is None and cfg.launcher.name is None:
            return None
        if other_launcher:
            raise KilnError(
                "Ray starts the workers: drop --nproc / --accelerate-config (launcher.num_workers and "
                "launcher.resources_per_worker say how many and what each gets)."
            )
        return run_from_cli(config, overrides, cfg, num_workers, max_restarts, train_loop)
    except Exception as err:  # noqa: BLE001 - a config or launch setting that cannot work: one line
        if "--traceback" in overrides:
            raise
        print(f"kiln: error: {err}", file=sys.stderr)
        return 2


def _mentions_launcher(config: str, overrides: Sequence[str]) -> bool:
    if any(o.startswith("launcher") for o in overrides):
        return True
    try:
        with open(config, encoding="utf-8") as fh:
            return "launcher" in fh.read()
    except OSError:  # the CLI's own load says what is wrong with the file
        return False


def run_from_cli(
    config: str,
    overrides: Sequence[str],
    cfg: Any,
    num_workers: int | None,
    max_restarts: int,
    train_loop: Callable[[dict[str, Any]], None],
) -> int:
    """`kiln fit --ray N CONFIG ...` / `launcher.name: ray`: start the run, print where Ray keeps it;
    returns the exit code (one line on stderr when the run failed)."""
    import sys

    launch = RayLaunch.from_config(cfg, num_workers, max_restarts)
    # the workers run in Ray's folder: the config file and output_dir are named absolutely
    argv = [os.path.abspath(config), *overrides, f"output_dir={os.path.abspath(str(cfg.output_dir))}"]
    try:
        result = launch_ray(argv, launch, train_loop)
    except KilnError:
        raise
    except KeyboardInterrupt:  # Ctrl-C: Ray stopped the workers; the shell's exit code for SIGINT
        print("kiln: interrupted; the Ray run stopped.", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - Ray's TrainingFailedError and the errors it wraps
        print(f"kiln: error: the Ray Train run failed: {_first_line(err)}", file=sys.stderr)
        return 1
    if result.error is not None:  # Ray versions that return the error instead of raising it
        print(f"kiln: error: the Ray Train run failed: {_first_line(result.error)}", file=sys.stderr)
        return 1
    where = result.checkpoint.path if result.checkpoint is not None else "none reported"
    print(f"kiln: Ray run {launch.name} done; Ray's last checkpoint: {where}", flush=True)
    return 0


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
