"""`kiln fit|evaluate|predict CONFIG.yaml [key=value ...]`, `kiln plot`, `kiln config-docs`.

The config names what to train by import path (`task.model`, `task.data`); overrides use
OmegaConf dotlist syntax, and Hugging Face TrainingArguments names work as keys."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, Optional, Sequence

USAGE = """kiln: train PyTorch models from a YAML config.

commands:
  kiln fit CONFIG.yaml [key=value ...]        train (then evaluate and export the model)
  kiln evaluate CONFIG.yaml [key=value ...]   evaluate a model (resume_from_checkpoint=PATH to load weights)
  kiln predict CONFIG.yaml [key=value ...]    predict on the eval/test data, write predictions.npy
  kiln plot RUN_DIR [RUN_DIR ...] [-o PNG]    plot a run's curves
  kiln config-docs                            print the config reference (markdown)
  kiln convert CHECKPOINT OUT                 write a checkpoint's full weights (also a sharded FSDP one) to OUT/model.safetensors

options for fit/evaluate/predict:
  --nproc N     start N local processes (data parallel) with torch's elastic launcher
  --accelerate-config FILE   honour an `accelerate config` YAML (mixed precision, FSDP, DeepSpeed, num_processes)
  -h, --help    list every config key with its default and meaning

examples:
  kiln fit examples/char_lm/config.yaml
  kiln fit examples/digits/config.yaml learning_rate=1e-3 train.max_steps=200 precision=bf16
"""


def _import(path: str, key: str) -> Callable[..., Any]:
    import os

    if os.getcwd() not in sys.path:  # like `python -m`: modules next to where kiln is run are importable
        sys.path.insert(0, os.getcwd())
    module_name, _, attr = path.partition(":")
    if not attr:
        module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"kiln: cannot import {key}={path!r} ({err}). Use 'package.module:callable'.") from None


def _build(cfg: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
    """Import task.data (called now) and task.model (called by the Trainer after seeding)."""
    if not cfg.task.data or not cfg.task.model:
        raise SystemExit("kiln: the config must name task.model and task.data ('package.module:callable').")
    from omegaconf import OmegaConf

    data = _import(cfg.task.data, "task.data")(**OmegaConf.to_container(cfg.task.data_args))
    if not isinstance(data, dict) or "train_dataset" not in data and "eval_dataset" not in data:
        raise SystemExit("kiln: task.data must return a dict with train_dataset (and optionally eval_dataset, ...).")
    model_fn = _import(cfg.task.model, "task.model")
    kwargs = {**OmegaConf.to_container(cfg.task.model_args), **data.get("model_args", {})}
    return (lambda: model_fn(**kwargs)), data


def _trainer(cfg: Any) -> tuple[Any, dict[str, Any]]:
    from kiln import Trainer

    model_init, data = _build(cfg)
    trainer = Trainer(
        None, cfg, model_init=model_init, train_dataset=data.get("train_dataset"), eval_dataset=data.get("eval_dataset"),
        data_collator=data.get("data_collator"), compute_metrics=data.get("compute_metrics"), callbacks=data.get("callbacks"),
        preprocess_logits_for_metrics=data.get("preprocess_logits_for_metrics"),
    )
    return trainer, data


def _run(command: str, config: str, overrides: list[str]) -> int:
    from kiln.config import ConfigError
    from kiln.utils.errors import KilnError
    from kiln.registry import UnknownNameError
    from kiln.strategies.environment import load_with_launcher_settings

    try:
        cfg = load_with_launcher_settings(config, overrides)  # accelerate launch fills keys the config leaves unset
        trainer, data = _trainer(cfg)
        if command == "fit":
            result = trainer.fit()
            trainer.log_metrics("train", result.metrics)
            trainer.save_metrics("train", result.metrics)
            if data.get("eval_dataset") is not None:
                metrics = trainer.evaluate()
                trainer.log_metrics("eval", metrics)
                trainer.save_metrics("eval", metrics)
            trainer.save_model()
            trainer.save_state()
        elif command == "evaluate":
            _load_weights(trainer)
            metrics = trainer.evaluate()
            trainer.log_metrics("eval", metrics)
            trainer.save_metrics("eval", metrics)
        else:
            _load_weights(trainer)
            dataset = data.get("test_dataset", data.get("eval_dataset"))
            out = trainer.predict(dataset)
            if trainer.is_world_process_zero():
                import os

                import numpy as np

                os.makedirs(cfg.output_dir, exist_ok=True)
                np.save(os.path.join(cfg.output_dir, "predictions.npy"), out.predictions)
            trainer.log_metrics("test", out.metrics)
    except (ConfigError, KilnError, UnknownNameError, ValueError) as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return 2
    return 0


def _load_weights(trainer: Any) -> None:
    path = trainer.config.resume_from_checkpoint
    if path:
        from kiln.engine.checkpoint.weights import load_weights_for_eval

        load_weights_for_eval(trainer, path)


def _convert(rest: list[str]) -> int:
    if len(rest) != 2 or rest[0].startswith("-"):
        print("usage: kiln convert CHECKPOINT OUT", file=sys.stderr)
        return 2
    from kiln.engine.checkpoint.convert import convert_checkpoint
    from kiln.utils.errors import KilnError

    try:
        print(convert_checkpoint(rest[0], rest[1]))
    except KilnError as err:
        print(f"kiln convert: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
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
    if command not in ("fit", "train", "evaluate", "predict"):
        print(f"kiln: unknown command {command!r}.\n\n{USAGE}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"kiln {command}", add_help=False)
    parser.add_argument("config", nargs="?")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--accelerate-config", dest="accelerate_config", default=None)
    parser.add_argument("-h", "--help", action="store_true")
    ns, overrides = parser.parse_known_args(rest)
    if ns.help or not ns.config:
        from kiln.config.docs import config_help

        print(f"usage: kiln {command} CONFIG.yaml [--nproc N] [key=value ...]\n\nconfig keys:{config_help()}")
        return 0 if ns.help else 2
    bad = [o for o in overrides if "=" not in o]
    if bad:
        print(f"kiln: error: unrecognised argument {bad[0]!r}; overrides look like key=value.", file=sys.stderr)
        return 2
    if ns.nproc > 1 or ns.accelerate_config:
        from kiln.strategies.launch import launch_local

        return launch_local(ns.nproc if ns.nproc > 1 else 0, ["-m", "kiln.cli", "fit" if command == "train" else command, ns.config, *overrides], accelerate_config=ns.accelerate_config)
    return _run("fit" if command == "train" else command, ns.config, overrides)


if __name__ == "__main__":
    sys.exit(main())
