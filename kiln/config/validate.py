"""Checks on values that a type alone cannot express. Each failure is one sentence naming the key
and the fix, raised before any model, data or process group is touched."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kiln.config.activation_checkpointing import check_section as check_activation_checkpointing
from kiln.config.compile import check_compile_mode, check_regions
from kiln.utils.errors import ConfigError

INTERVALS = ("no", "steps", "epoch")
LEVELS = ("debug", "info", "warning", "error", "critical", "passive")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"Config key {key!r} is {value!r}; choose one of {', '.join(choices)}.")


def _positive(key: str, value: Any, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"Config key {key!r} must be {bound}, got {value!r}.")


def _interval_steps(key: str, value: Any) -> None:
    """`*_steps` is an int >= 1 or a ratio in (0, 1) of the total steps (HF semantics)."""
    if value is None:
        return
    if value <= 0 or (value >= 1 and float(value) != int(value)):
        raise ConfigError(f"Config key {key!r} must be an integer >= 1 or a ratio in (0, 1), got {value!r}.")


def validate(cfg: DictConfig) -> None:
    t, e, s, lg = cfg.train, cfg.eval, cfg.save, cfg.log
    _positive("train.gradient_accumulation_steps", t.gradient_accumulation_steps)
    _positive("train.max_grad_norm", t.max_grad_norm, allow_zero=True)
    _positive("train.num_train_epochs", t.num_train_epochs, allow_zero=True)
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError(
            f"Config key 'train.max_steps' must be > 0, or -1 to use num_train_epochs; got {t.max_steps}."
        )
    _positive("train.max_nonfinite_steps", t.max_nonfinite_steps, allow_zero=True)
    if cfg.strategy.timeout <= 0:
        raise ConfigError(
            f"Config key 'strategy.timeout' (ddp_timeout) is the seconds a collective may wait and must be > 0, "
            f"got {cfg.strategy.timeout}."
        )
    if t.torch_compile_backend is not None:
        _check_compile_backend(t.torch_compile_backend)
    check_compile_mode(t.torch_compile_mode)
    check_regions(cfg.torch_compile.regions)
    if t.neftune_noise_alpha is not None:
        _positive("train.neftune_noise_alpha", t.neftune_noise_alpha)
    _positive("data.per_device_train_batch_size", cfg.data.per_device_train_batch_size)
    _positive("data.per_device_eval_batch_size", cfg.data.per_device_eval_batch_size)
    _positive("data.dataloader_num_workers", cfg.data.dataloader_num_workers, allow_zero=True)
    _positive("optim.lr", cfg.optim.lr, allow_zero=True)
    _positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    _positive("scheduler.warmup_steps", cfg.scheduler.warmup_steps, allow_zero=True)
    if not 0 <= cfg.scheduler.warmup_ratio <= 1:
        raise ConfigError(f"Config key 'scheduler.warmup_ratio' must be in [0, 1], got {cfg.scheduler.warmup_ratio}.")
    _choice("eval.strategy", e.strategy, INTERVALS)
    _choice("save.strategy", s.strategy, INTERVALS + ("best",))
    _choice("log.strategy", lg.strategy, INTERVALS)
    _choice("log.level", lg.level, LEVELS)
    _choice("log.level_replica", lg.level_replica, LEVELS)
    _choice("log.model_summary", lg.model_summary, ("auto", "table", "line", "off"))
    if lg.model_summary_depth < -1:
        raise ConfigError(
            f"Config key 'log.model_summary_depth' must be -1 (every module) or >= 0, got {lg.model_summary_depth}."
        )
    _choice("log.nonfinite_window", lg.nonfinite_window, ("nan", "filtered"))
    for key, value in (("eval.steps", e.steps), ("save.steps", s.steps), ("log.steps", lg.steps)):
        _interval_steps(key, value)
    _positive("eval.accumulation_steps", e.accumulation_steps)
    _positive("save.total_limit", s.total_limit)
    if cfg.precision.full_eval is not None:
        _choice("precision.full_eval", cfg.precision.full_eval, ("fp16", "bf16"))
    _choice("precision.fp16_opt_level", cfg.precision.fp16_opt_level, ("O0", "O1", "O2", "O3"))
    _choice(
        "precision.half_precision_backend",
        cfg.precision.half_precision_backend,
        ("auto", "cpu_amp", "cuda_amp", "apex"),
    )
    _check_float8(cfg)
    if lg.log_artifacts is not None:
        _choice("log.log_artifacts", str(lg.log_artifacts).lower(), ("false", "end", "checkpoint"))
    check_activation_checkpointing(cfg)
    _check_loss(cfg.train)
    _check_names(cfg)
    _check_data_and_debug(cfg)
    _check_best_model(cfg)
    _check_output_dir(cfg.output_dir)


def _check_loss(train: Any) -> None:
    if train.loss.chunk_size < 1:
        raise ConfigError(f"train.loss.chunk_size is {train.loss.chunk_size}; it must be a positive number of tokens.")
    if train.loss.chunked and train.label_smoothing_factor:
        raise ConfigError(
            "train.loss.chunked cannot smooth labels (label_smoothing_factor smooths the loss of the whole logits); "
            "drop one of them."
        )


def _check_names(cfg: DictConfig) -> None:
    """Unknown strategy/precision/optimizer/scheduler/logger names fail here, listing the valid ones
    (config's own vocabulary, kiln.config.names: nothing above config is imported)."""
    from kiln.config.names import check_name
    from kiln.registry import UnknownNameError

    try:
        for key in ("strategy.name", "precision.name", "optim.name", "scheduler.name"):
            check_name(key, OmegaConf.select(cfg, key))
        for name in list(cfg.log.report_to) + list(cfg.log.history or []):
            if name not in ("all", "none"):
                check_name("log.report_to", name)
    except UnknownNameError as err:
        raise ConfigError(str(err)) from None


def _check_float8(cfg: DictConfig) -> None:
    """`precision.fp8` / `precision.mxfp8` settings belong to their plugin; under another they would do nothing."""
    from kiln.config.names import FLOAT8_RECIPES, MXFP8_RECIPES
    from kiln.config.schema.precision import Float8Config, MXFP8Config

    fp8 = cfg.precision.fp8
    _choice("precision.fp8.recipe", fp8.recipe, FLOAT8_RECIPES)
    _choice("precision.mxfp8.recipe", cfg.precision.mxfp8.recipe, MXFP8_RECIPES)
    if fp8.fsdp_float8_all_gather and fp8.recipe != "tensorwise":
        raise ConfigError(
            f"precision.fp8.fsdp_float8_all_gather needs one scale per weight, which recipe {fp8.recipe!r} does "
            "not have; use recipe: tensorwise, or drop fsdp_float8_all_gather."
        )
    for key, names, default, what in (
        ("fp8", ("fp8", "float8"), Float8Config(), "float8"),
        ("mxfp8", ("mxfp8",), MXFP8Config(), "MXFP8"),
    ):
        if cfg.precision.name not in names and OmegaConf.to_container(cfg.precision[key]) != asdict(default):
            raise ConfigError(
                f"precision.{key} is set but precision is {cfg.precision.name!r}; use precision: {key} to train in "
                f"{what}, or drop precision.{key}."
            )


def _check_data_and_debug(cfg: DictConfig) -> None:
    """accelerator_config's data options and `debug` values kiln cannot honour."""
    if not cfg.data.use_seedable_sampler:
        raise ConfigError(
            "data.use_seedable_sampler=false would draw the shuffle order from the global RNG, which a "
            "resumed run cannot reproduce; drop it (kiln's order depends only on data_seed and epoch)."
        )
    for item in cfg.train.debug:
        _choice("train.debug", item, ("underflow_overflow", "tpu_metrics_debug"))
    if "tpu_metrics_debug" in cfg.train.debug and cfg.strategy.name not in ("xla", "xla_fsdp"):
        raise ConfigError(
            f"debug 'tpu_metrics_debug' prints the XLA metrics report, but strategy is "
            f"{cfg.strategy.name!r}; use strategy xla or xla_fsdp, or drop it."
        )
    _positive("train.torch_empty_cache_steps", cfg.train.torch_empty_cache_steps)
    if cfg.data.dataloader_multiprocessing_context is not None:
        _choice(
            "data.dataloader_multiprocessing_context",
            cfg.data.dataloader_multiprocessing_context,
            ("fork", "spawn", "forkserver"),
        )


def _check_best_model(cfg: DictConfig) -> None:
    e, s = cfg.eval, cfg.save
    # HF raises too, in these words; with load_best_model_at_end HF's arguments default the metric to the loss (as
    # kiln does)
    if s.strategy == "best" and not e.metric_for_best_model and not e.load_best_model_at_end:
        raise ConfigError(
            "`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
            "`args.load_best_model_at_end` is set to `True`: set eval.metric_for_best_model "
            "(metric_for_best_model) to the metric that decides which evaluation is best, e.g. 'loss'."
        )
    if s.strategy == "best" and e.strategy == "no":  # it would train to the end without saving anything
        raise ConfigError(
            "save.strategy 'best' saves when an evaluation improves the best metric, but eval.strategy "
            "is 'no': set eval.strategy to 'steps' or 'epoch', or save on 'steps' or 'epoch'."
        )
    if not e.load_best_model_at_end:
        return
    if e.strategy == "no":
        raise ConfigError(
            "load_best_model_at_end needs evaluation during training: set eval.strategy to 'steps' or 'epoch'."
        )
    if s.strategy not in (e.strategy, "best"):
        raise ConfigError(
            f"load_best_model_at_end needs save.strategy ({s.strategy!r}) to match eval.strategy ({e.strategy!r}) "
            "so that every evaluated model has a checkpoint."
        )
    if e.strategy == "steps" and s.strategy == "steps":
        eval_steps = e.steps if e.steps is not None else cfg.log.steps
        if eval_steps >= 1 and s.steps >= 1 and int(s.steps) % int(eval_steps) != 0:
            raise ConfigError(
                f"load_best_model_at_end needs save.steps ({_num(s.steps)}) to be a multiple of eval.steps ({_num(eval_steps)})."
            )


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _check_output_dir(path: str) -> None:
    """An empty path, or a file where the run's folder should be, would fail only at the first save,
    after the model and data were built."""
    import os

    if not path:
        raise ConfigError(
            "output_dir is empty (''); name the folder for checkpoints and logs, e.g. output_dir: out "
            "(leave the key out for the default 'tmp_trainer')."
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"output_dir {path!r} is a file, not a folder; pick another output_dir.")


def _check_compile_backend(name: str) -> None:
    """An unknown torch.compile backend would fail at the first forward, after the model and data
    were built. Importing torch._dynamo costs seconds, so only a config that compiles pays it."""
    import torch._dynamo

    if name not in torch._dynamo.list_backends(exclude_tags=()):  # registered ones, entry points included
        raise ConfigError(
            f"Config key 'train.torch_compile_backend' is {name!r}, which torch.compile does not know; "
            f"choose one of {', '.join(torch._dynamo.list_backends())} (or register yours as a "
            "torch_dynamo_backends entry point)."
        )
