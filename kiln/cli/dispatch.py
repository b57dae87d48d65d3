"""`kiln COMMAND ...`: which function runs a command. The commands without a run (`plot`,
`config-docs`, `convert`, `estimate`) are one entry each in COMMANDS; `fit`, `evaluate` and `predict` parse their
options here, then go to Ray Train's workers (`--ray`), to the local launcher (`--nproc`,
`--accelerate-config`, `--max-restarts`), or run in this process (kiln/cli/run.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kiln.cli.help import USAGE, command_help
from kiln.cli.run import run_command

if TYPE_CHECKING:
    from kiln.launch.settings import LauncherSetting


def _plot(rest: list[str]) -> int:
    from kiln.plot import main as plot_main

    return int(plot_main(rest) or 0)


def _config_docs(rest: list[str]) -> int:
    from kiln.config.docs import config_markdown

    print(config_markdown(), end="")
    return 0


def _convert(rest: list[str]) -> int:
    from kiln.cli.convert import convert

    return convert(rest)


def _estimate(rest: list[str]) -> int:
    from kiln.estimate.command import main

    return main(rest)


#: command -> its function of the remaining arguments, returning the exit code
COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "plot": _plot,
    "config-docs": _config_docs,
    "convert": _convert,
    "estimate": _estimate,
}
#: the commands that run a config (`train` is HF's name for `fit`)
RUN_COMMANDS = ("fit", "train", "evaluate", "predict")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a usage error, as for any command-line tool: help on stderr, exit 2
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if args[0] in ("--version", "-V", "version"):
        from kiln import __version__

        print(f"kiln {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command in COMMANDS:
        return COMMANDS[command](rest)
    if command not in RUN_COMMANDS:
        print(f"kiln: unknown command {command!r}.\n\n{USAGE}", file=sys.stderr)
        return 2
    return _run_config("fit" if command == "train" else command, rest)


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kiln {command}", add_help=False)
    parser.add_argument("config", nargs="?")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=0)
    parser.add_argument("--ray", type=int, default=None)
    parser.add_argument("--accelerate-config", dest="accelerate_config", default=None)
    parser.add_argument("--launcher-settings", dest="launcher_settings", default=None, help=argparse.SUPPRESS)
    if command != "fit":
        parser.add_argument("--weights", default=None)
        parser.add_argument("--random-weights", dest="random_weights", action="store_true")
    else:
        parser.add_argument("--profile", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def _run_config(command: str, rest: list[str]) -> int:
    """`kiln fit|evaluate|predict CONFIG [options] [key=value ...]`."""
    ns, overrides = _parser(command).parse_known_args(rest)
    if ns.help or not ns.config:
        print(command_help(command))
        return 0 if ns.help else 2
    # --traceback rides along with the overrides, so kiln's launcher hands it to its workers unchanged
    show_traceback = "--traceback" in overrides
    bad = [o for o in overrides if "=" not in o and o != "--traceback"]
    if bad:
        print(f"kiln: error: unrecognised argument {bad[0]!r}; overrides look like key=value.", file=sys.stderr)
        return 2
    if getattr(ns, "profile", False):  # an override like any other, so every launcher hands it to its workers
        from kiln.cli.fit import profile_overrides

        overrides = [*overrides, *profile_overrides(ns.config, overrides)]
    weights, random_weights = getattr(ns, "weights", None), getattr(ns, "random_weights", False)
    if command == "fit" or ns.ray is not None:  # `--ray N` or `launcher.name: ray`: the run goes to Ray Train's workers
        from kiln.launch.ray import fit_with_ray

        code = fit_with_ray(
            command,
            ns.config,
            overrides,
            ns.ray,
            ns.nproc != 1 or bool(ns.accelerate_config),
            ns.max_restarts,
            train_loop=train_loop_per_worker,
        )
        if code is not None:
            return code
    # --nproc 0 / -1 reach launch_local, which refuses them; --max-restarts alone restarts one process
    if ns.nproc != 1 or ns.accelerate_config or ns.max_restarts:
        return _launch_local(command, ns, overrides, weights, random_weights)
    received: list[LauncherSetting] | None = None
    if ns.launcher_settings:
        from kiln.launch.settings import settings_from_json

        received = settings_from_json(ns.launcher_settings)
    overrides = [o for o in overrides if o != "--traceback"]
    return run_command(command, ns.config, overrides, weights, random_weights, received, show_traceback)


def _launch_local(command: str, ns: Any, overrides: list[str], weights: str | None, random_weights: bool) -> int:
    """The command in `--nproc` local processes (or as many as `--accelerate-config` names), each running
    `python -m kiln.cli` with the same arguments."""
    from kiln.launch.local import launch_local
    from kiln.launch.settings import accelerate_config_settings, settings_to_json

    flags = ([f"--weights={weights}"] if weights else []) + (["--random-weights"] if random_weights else [])
    nproc = ns.nproc
    devices: dict[str, str] = {}
    try:
        if ns.accelerate_config:  # its settings travel to the workers as an argument, not as variables
            num, settings, devices = accelerate_config_settings(ns.accelerate_config)
            nproc = num if ns.nproc == 1 else nproc
            flags.append(f"--launcher-settings={settings_to_json(settings)}")
        return launch_local(
            nproc,
            ["-m", "kiln.cli", command, ns.config, *flags, *overrides],
            extra_env=devices,
            max_restarts=ns.max_restarts,
        )
    except ValueError as err:  # a launch setting that cannot work (the workers' errors are reported, not raised)
        print(f"kiln: error: {err}", file=sys.stderr)
        return 2


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function: `kiln fit` with `config["argv"]` (the config file and its
    overrides) in this worker, in `config["cwd"]` when given; a worker of a restarted group resumes from
    the checkpoint Ray hands back. Usable with a TorchTrainer of your own:
    `TorchTrainer(train_loop_per_worker, train_loop_config={"argv": ["config.yaml", "key=value"]}, ...)`."""
    from kiln.launch.ray import run_worker

    run_worker(config, lambda argv: main(["fit", *argv]))
