"""`kiln fit|evaluate|predict CONFIG.yaml [key=value ...]`, `kiln plot`, `kiln config-docs`.

The config names what to train by import path (`task.model`, `task.data`); overrides use
OmegaConf dotlist syntax, and Hugging Face TrainingArguments names work as keys."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from kiln.task_import import TaskError

if TYPE_CHECKING:
    from kiln.launch.settings import LauncherSetting

#: optimizer steps `kiln fit --profile` records
PROFILE_STEPS = 3

USAGE = """kiln: train PyTorch models from a YAML config.

commands:
  kiln fit CONFIG.yaml [key=value ...]        train (then evaluate and export the model)
  kiln evaluate CONFIG.yaml [key=value ...]   evaluate the run's trained weights (or --weights PATH)
  kiln predict CONFIG.yaml [key=value ...]    predict on the test/eval data with them, write predictions.npy
  kiln plot RUN_DIR [RUN_DIR ...] [-o PNG]    plot a run's curves
  kiln config-docs                            print the config reference (markdown)
  kiln convert CHECKPOINT OUT [--signing-key-env NAME]
                                              a checkpoint's full weights (FSDP or ZeRO shards merged) as
                                              OUT/model.safetensors (signed checkpoints: the key is in $NAME);
                                              CHECKPOINT may be a URL (s3://bucket/run/checkpoint-500)
  kiln estimate CONFIG.yaml [--nproc N] [--device-memory GiB] [--json] [key=value ...]
                                              per-rank memory for each strategy and mesh, and what fits
  kiln --version                              print kiln's version

options for fit/evaluate/predict:
  --nproc N                  start N local processes (data parallel) with torch's elastic launcher
  --max-restarts K           with --nproc: restart the processes up to K times when one fails (torchrun's flag)
  --ray N                    fit in N Ray Train workers (a local Ray instance, or launcher.address); pip install 'kiln[ray]'
  --accelerate-config FILE   honour an `accelerate config` YAML (mixed precision, FSDP, DeepSpeed, num_processes)
  --traceback                show the full traceback of an error (default: one line naming the problem)
  -h, --help                 list every config key with its default and meaning

options for fit:
  --profile                  profile 3 optimizer steps (profile.active=3) unless the config or a key=value sets it

options for evaluate/predict:
  --weights PATH             a checkpoint-<step> folder (or its URL on a store) or a folder written by save_model;
                             default: the run's best checkpoint, else its exported model, else its newest
                             checkpoint (in output_dir; for an output_dir URL, downloaded when none is local)
  --random-weights           score the untrained model (refused unless asked for)

examples:
  kiln fit examples/digits/config.yaml learning_rate=1e-3 train.max_steps=200 precision=bf16
  kiln evaluate examples/digits/config.yaml                    # the weights kiln fit left in runs/digits
  kiln predict examples/digits/config.yaml --weights runs/digits/checkpoint-400
"""


#: what a `task.data` function may return (docs/training-module.md); the Trainer keywords go to the Trainer
DATA_KEYS = (
    "train_dataset",
    "eval_dataset",
    "test_dataset",
    "data_collator",
    "compute_metrics",
    "preprocess_logits_for_metrics",
    "callbacks",
    "processing_class",
    "model_args",
)


def _check_data(data: Any, path: str) -> None:
    """The dict task.data returned: a dataset to work on, and no key kiln would drop unread (a typo such as
    `collate_fn` would otherwise train with the default collator)."""
    import difflib

    if not isinstance(data, dict) or "train_dataset" not in data and "eval_dataset" not in data:
        raise TaskError("task.data must return a dict with train_dataset (and optionally eval_dataset, ...).")
    unknown = [key for key in data if key not in DATA_KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), DATA_KEYS, n=1, cutoff=0.5)  # collate_fn: data_collator
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TaskError(
            f"task.data ({path}) returned {unknown[0]!r}, which kiln does not read; it reads "
            f"{', '.join(DATA_KEYS)} (docs/training-module.md).{hint}"
        )


def _build(cfg: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
    """Import task.data (called now) and task.model (called by the Trainer after seeding); every
    keyword argument is checked against the callables before anything is built."""
    from omegaconf import OmegaConf

    from kiln.task_import import check_kwargs, import_callable

    if not cfg.task.data or not cfg.task.model:
        raise TaskError("the config must name task.model and task.data ('package.module:callable').")
    model_fn = import_callable(cfg.task.model, "task.model")
    data_fn = import_callable(cfg.task.data, "task.data")
    # the schema types both Dict[str, Any]: to_container gives a dict with str keys
    model_args = cast(dict[str, Any], OmegaConf.to_container(cfg.task.model_args))
    data_args = cast(dict[str, Any], OmegaConf.to_container(cfg.task.data_args))
    check_kwargs(model_fn, model_args, "task.model_args", cfg.task.model)
    check_kwargs(data_fn, data_args, "task.data_args", cfg.task.data)
    data = data_fn(**data_args)
    _check_data(data, cfg.task.data)
    kwargs = {**model_args, **data.get("model_args", {})}
    check_kwargs(model_fn, kwargs, f"task.model_args (with the model_args {cfg.task.data} returned)", cfg.task.model)

    def build_model() -> Any:
        import torch

        model = model_fn(**kwargs)
        if not isinstance(model, torch.nn.Module):
            raise TaskError(
                f"task.model ({cfg.task.model}) returned a {type(model).__name__}, not a torch.nn.Module: "
                "return the model (a kiln TrainingModule, or a Transformers-style model that returns its loss)."
            )
        return model

    return build_model, data


def _trainer(cfg: Any) -> tuple[Any, dict[str, Any]]:
    from kiln import Trainer

    model_init, data = _build(cfg)
    trainer = Trainer(
        None,
        cfg,
        model_init=model_init,
        train_dataset=data.get("train_dataset"),
        eval_dataset=data.get("eval_dataset"),
        data_collator=data.get("data_collator"),
        compute_metrics=data.get("compute_metrics"),
        callbacks=data.get("callbacks"),
        preprocess_logits_for_metrics=data.get("preprocess_logits_for_metrics"),
        processing_class=data.get("processing_class"),
    )
    return trainer, data


def _run(
    command: str,
    config: str,
    overrides: list[str],
    weights: str | None = None,
    random_weights: bool = False,
    launcher: list[Any] | None = None,
    show_traceback: bool = False,
) -> int:
    from kiln.config import ConfigError
    from kiln.launch.environment import detect
    from kiln.launch.settings import load_with_launcher_settings
    from kiln.registry import UnknownNameError
    from kiln.utils.errors import KilnError

    try:
        if command != "fit":  # scoring weights must not touch the training run's history files or trackers
            overrides = [*overrides, "log.history=[]", "log.report_to=none"]
        cfg = load_with_launcher_settings(config, overrides, launcher)  # a launcher fills keys the config leaves unset
        chosen = None if command == "fit" else _pick_weights(cfg, weights, random_weights)
        trainer, data = _trainer(cfg)
        if command == "fit" and detect().source == "ray":  # a Ray Train worker: Ray keeps and restores the checkpoints
            from kiln.engine.callbacks.ray_report import RayReportCallback

            trainer.add_callback(RayReportCallback())
        # the Trainer is torn down when the process exits (Trainer.teardown's fallback): a process running
        # several commands (the tests) keeps one process group, as torch cannot meet twice at one env:// address
        if command == "fit":
            _fit(trainer, data)
        else:
            _score(command, trainer, data, chosen)
    except KeyboardInterrupt as err:  # Ctrl-C: one line from one process, the shell's exit code for SIGINT
        if detect().rank == 0:
            print(f"kiln: {err or 'interrupted'}", file=sys.stderr, flush=True)
        return 130
    except Exception as err:  # noqa: BLE001 - user code kiln calls can raise anything: one line, unless --traceback
        from kiln.launch.worker import peer_interrupted

        if isinstance(err, RuntimeError) and peer_interrupted():  # a peer's Ctrl-C broke this rank's collective
            if detect().rank == 0:
                print("kiln: interrupted", file=sys.stderr, flush=True)
            return 130
        if show_traceback:
            raise
        known = isinstance(err, (ConfigError, KilnError, UnknownNameError, TaskError))
        line = f"kiln: error: {err if known else error_line(err)}"
        from kiln.launch.worker import report_failure

        # under `kiln fit --nproc` a config error reaches every rank alike: the launcher says it once
        if not (known and report_failure(line.removeprefix("kiln: "))):
            print(line, file=sys.stderr)
        if isinstance(err, RuntimeError) and "torch.distributed" in sys.modules:
            from kiln.strategies.process_group import lost_peer_note

            note = lost_peer_note()  # a collective that lost its peer: name the rank that died
            if note:
                print(note, file=sys.stderr)
        return 2
    return 0


def error_line(err: BaseException) -> str:
    """One line for an error kiln did not phrase itself: kiln's own TypeError/ValueError sentences as
    they are; anything else (raised in the user's task code, or in a library kiln called) as its type
    and first line, where in the user's code it came from, and how to see the traceback."""
    import os
    import sysconfig
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    kiln_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    if (
        isinstance(err, (TypeError, ValueError))
        and frames
        and first
        and os.path.abspath(frames[-1].filename).startswith(kiln_dir)
    ):
        return first  # raised by kiln with its own sentence
    libraries = tuple(
        os.path.abspath(p) + os.sep for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    )
    user = [
        f
        for f in frames
        if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith((kiln_dir, *libraries))
    ]
    where = f" (in {user[-1].name}, {user[-1].filename}:{user[-1].lineno})" if user else ""
    what = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return f"{what}{where}; rerun with --traceback for the full traceback."


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function: `kiln fit` with `config["argv"]` (the config file and its
    overrides) in this worker, in `config["cwd"]` when given; a worker of a restarted group resumes from
    the checkpoint Ray hands back. Usable with a TorchTrainer of your own:
    `TorchTrainer(train_loop_per_worker, train_loop_config={"argv": ["config.yaml", "key=value"]}, ...)`."""
    from kiln.launch.ray import run_worker

    run_worker(config, lambda argv: main(["fit", *argv]))


def _fit(trainer: Any, data: dict[str, Any]) -> None:
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


def _pick_weights(cfg: Any, weights: str | None, random_weights: bool) -> Any:
    """The weights evaluate/predict score: --weights, resume_from_checkpoint=PATH, or the run's own;
    None only with --random-weights. Chosen before the model and data are built."""
    from kiln.engine.checkpoint.remote_run import fetch_checkpoint, options, store_of
    from kiln.engine.checkpoint.signing import signing_key
    from kiln.engine.checkpoint.weights import find_run_weights, given_weights
    from kiln.utils.errors import KilnError
    from kiln.utils.storage_urls import is_remote

    resume = cfg.resume_from_checkpoint
    if weights is None and resume and str(resume).lower() not in ("true", "false", "none", "if_exists"):
        weights = str(resume)  # `resume_from_checkpoint=PATH` names the weights too
    if random_weights:
        if weights is not None:
            raise KilnError("--random-weights and --weights contradict each other; pass one of them.")
        return None
    key = signing_key(cfg.save.signing_key_env)  # signed checkpoints only, when set
    if weights is not None:
        if is_remote(weights):  # a checkpoint on a store: downloaded, digests checked
            weights = fetch_checkpoint(weights, options(cfg), key)
        return given_weights(weights, key)
    found = find_run_weights(cfg.output_dir, key)
    store = store_of(cfg)
    if found is None and store is not None and store.download_newest(cfg.output_dir, key) is not None:
        found = find_run_weights(cfg.output_dir, key)  # the run's store: its newest intact checkpoint
    if found is None:
        import os

        where = "" if os.path.isabs(cfg.output_dir) else f" (in {os.getcwd()})"
        raise KilnError(
            f"output_dir {cfg.output_dir!r}{where} holds no checkpoint or exported model to score; pass --weights PATH "
            "(a checkpoint-<step> folder or a save_model folder), or --random-weights for the untrained model."
        )
    return found


def _score(command: str, trainer: Any, data: dict[str, Any], weights: Any) -> None:
    """evaluate / predict with `weights`, writing the results into the weights' folder."""
    import json
    import os

    if weights is not None:
        trainer._load_from_checkpoint(weights.path)
        trainer.state.global_step, trainer.state.epoch = weights.step or 0, weights.epoch  # reported with the metrics
        where, about = weights.path, {"weights": weights.path, "step": weights.step}
    else:
        where, about = os.path.join(trainer.config.output_dir, "random-weights"), {"weights": None, "step": 0}
    zero = trainer.is_world_process_zero()
    if zero:
        verb = "evaluating" if command == "evaluate" else "predicting with"
        print(
            f"kiln: {verb} the {weights.describe()}"
            if weights is not None
            else f"kiln: {verb} the untrained model (--random-weights); results go to {where}",
            flush=True,
        )
    if command == "evaluate":
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        name = "evaluate_results.json"
    else:
        dataset = data.get("test_dataset", data.get("eval_dataset"))
        out = trainer.predict(dataset)
        metrics = out.metrics
        trainer.log_metrics("test", metrics)
        name = "predict_results.json"
        if zero:
            import numpy as np

            os.makedirs(where, exist_ok=True)
            np.save(os.path.join(where, "predictions.npy"), out.predictions)
    if zero:
        from kiln.engine.evaluation.outputs import to_python

        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, name), "w", encoding="utf-8") as fh:
            json.dump({**about, **{k: to_python(v) for k, v in metrics.items()}}, fh, indent=2)
        print(f"kiln: wrote {os.path.join(where, name)}", flush=True)


def _help(command: str) -> str:
    from kiln.config.docs import config_help

    scoring = command in ("evaluate", "predict")
    lines = [
        f"usage: kiln {command} CONFIG.yaml [--nproc N [--max-restarts K]] [--accelerate-config FILE]"
        f"{' [--weights PATH | --random-weights]' if scoring else ' [--profile]'} [key=value ...]",
        "",
        "options:",
        "  --nproc N                  start N local processes (data parallel)",
        "  --max-restarts K           with --nproc: restart them up to K times when one fails (with --ray: Ray's max_failures)",
        "  --ray N                    fit in N Ray Train workers (config launcher.* for resources and address)",
        "  --accelerate-config FILE   honour an `accelerate config` YAML",
        "  --traceback                show the full traceback of an error, not one line",
    ]
    if command == "fit":
        lines.append(
            "  --profile                  profile 3 optimizer steps (profile.active=3) unless the config or a key=value sets it"
        )
    if scoring:
        lines += [
            "  --weights PATH             a checkpoint-<step> folder or a save_model folder (default: the run's best",
            "                             checkpoint, else its exported model, else its newest checkpoint)",
            "  --random-weights           score the untrained model",
        ]
    lines += ["", "config keys (in the YAML, or key=value on the command line):", "", config_help()]
    return "\n".join(lines)


def _profile_overrides(config: str, overrides: list[str]) -> list[str]:
    """`kiln fit --profile`: record 3 optimizer steps (wait and warmup keep their defaults), unless the
    config file or a `key=value` already sets `profile.active`, which then wins."""
    from kiln.launch.settings import explicit_keys

    given = explicit_keys(config, [o for o in overrides if o != "--traceback"])
    return [] if "profile.active" in given else [f"profile.active={PROFILE_STEPS}"]


def _convert(rest: list[str]) -> int:
    env = None
    if len(rest) == 4 and rest[2] == "--signing-key-env":
        rest, env = rest[:2], rest[3]
    if len(rest) != 2 or rest[0].startswith("-"):
        print("usage: kiln convert CHECKPOINT OUT [--signing-key-env NAME]", file=sys.stderr)
        return 2
    from kiln.engine.checkpoint.convert import convert_checkpoint
    from kiln.engine.checkpoint.signing import signing_key
    from kiln.utils.errors import KilnError

    try:
        print(convert_checkpoint(rest[0], rest[1], signing_key(env)))
    except KilnError as err:
        print(f"kiln convert: {err}", file=sys.stderr)
        return 1
    return 0


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
    if command == "plot":
        from kiln.plot import main as plot_main

        return int(plot_main(rest) or 0)
    if command == "config-docs":
        from kiln.config.docs import config_markdown

        print(config_markdown(), end="")
        return 0
    if command == "convert":
        return _convert(rest)
    if command == "estimate":
        from kiln.estimate.command import main as estimate_main

        return estimate_main(rest)
    if command not in ("fit", "train", "evaluate", "predict"):
        print(f"kiln: unknown command {command!r}.\n\n{USAGE}", file=sys.stderr)
        return 2
    command = "fit" if command == "train" else command
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
    ns, overrides = parser.parse_known_args(rest)
    if ns.help or not ns.config:
        print(_help(command))
        return 0 if ns.help else 2
    # --traceback rides along with the overrides, so kiln's launcher hands it to its workers unchanged
    show_traceback = "--traceback" in overrides
    bad = [o for o in overrides if "=" not in o and o != "--traceback"]
    if bad:
        print(f"kiln: error: unrecognised argument {bad[0]!r}; overrides look like key=value.", file=sys.stderr)
        return 2
    if getattr(ns, "profile", False):  # an override like any other, so every launcher hands it to its workers
        overrides = [*overrides, *_profile_overrides(ns.config, overrides)]
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
    received: list[LauncherSetting] | None = None
    if ns.launcher_settings:
        from kiln.launch.settings import settings_from_json

        received = settings_from_json(ns.launcher_settings)
    overrides = [o for o in overrides if o != "--traceback"]
    return _run(command, ns.config, overrides, weights, random_weights, received, show_traceback)


if __name__ == "__main__":
    sys.exit(main())
