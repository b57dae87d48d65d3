"""Every range/choice check of kiln.config.validate has its own bad-input case (so removing any one
check fails a test), and the boundary values HF accepts stay accepted (so an over-strict check fails
too). Each refusal is one sentence that names the key and the value."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.config import ConfigError, load_config

BAD: list[tuple[dict[str, Any], str]] = [
    ({"gradient_accumulation_steps": -1}, "'train.gradient_accumulation_steps' must be > 0, got -1"),
    ({"max_grad_norm": -0.5}, "'train.max_grad_norm' must be >= 0, got -0.5"),
    ({"num_train_epochs": -1.0}, "'train.num_train_epochs' must be >= 0, got -1.0"),
    ({"max_steps": 0}, "'train.max_steps' must be > 0, or -1 to use num_train_epochs; got 0"),
    ({"max_steps": -2}, "'train.max_steps' must be > 0, or -1 to use num_train_epochs; got -2"),
    ({"neftune_noise_alpha": 0.0}, "'train.neftune_noise_alpha' must be > 0, got 0.0"),
    ({"per_device_train_batch_size": 0}, "'data.per_device_train_batch_size' must be > 0, got 0"),
    ({"per_device_eval_batch_size": 0}, "'data.per_device_eval_batch_size' must be > 0, got 0"),
    ({"dataloader_num_workers": -1}, "'data.dataloader_num_workers' must be >= 0, got -1"),
    ({"learning_rate": -1e-3}, "'optim.lr' must be >= 0, got -0.001"),
    ({"weight_decay": -0.1}, "'optim.weight_decay' must be >= 0, got -0.1"),
    ({"warmup_steps": -1}, "'scheduler.warmup_steps' must be >= 0, got -1"),
    ({"warmup_ratio": 1.5}, "'scheduler.warmup_ratio' must be in [0, 1], got 1.5"),
    ({"warmup_ratio": -0.1}, "'scheduler.warmup_ratio' must be in [0, 1], got -0.1"),
    ({"eval_strategy": "always"}, "'eval.strategy' is 'always'; choose one of no, steps, epoch"),
    ({"save_strategy": "always"}, "'save.strategy' is 'always'; choose one of no, steps, epoch, best"),
    ({"logging_strategy": "always"}, "'log.strategy' is 'always'; choose one of no, steps, epoch"),
    (
        {"log_level": "verbose"},
        "'log.level' is 'verbose'; choose one of debug, info, warning, error, critical, passive",
    ),
    ({"log_level_replica": "loud"}, "'log.level_replica' is 'loud'; choose one of debug, info"),
    ({"eval_steps": 2.5}, "'eval.steps' must be an integer >= 1 or a ratio in (0, 1), got 2.5"),
    ({"eval_steps": 0}, "'eval.steps' must be an integer >= 1 or a ratio in (0, 1), got 0"),
    ({"save_steps": 1.5}, "'save.steps' must be an integer >= 1 or a ratio in (0, 1), got 1.5"),
    ({"save_steps": -3}, "'save.steps' must be an integer >= 1 or a ratio in (0, 1), got -3"),
    ({"logging_steps": 0}, "'log.steps' must be an integer >= 1 or a ratio in (0, 1), got 0"),
    ({"eval_accumulation_steps": 0}, "'eval.accumulation_steps' must be > 0, got 0"),
    ({"save_total_limit": 0}, "'save.total_limit' must be > 0, got 0"),
    ({"precision": {"full_eval": "fp8"}}, "'precision.full_eval' is 'fp8'; choose one of fp16, bf16"),
    ({"fp16_opt_level": "O4"}, "'precision.fp16_opt_level' is 'O4'; choose one of O0, O1, O2, O3"),
    ({"half_precision_backend": "tpu"}, "'precision.half_precision_backend' is 'tpu'; choose one of auto, cpu_amp"),
    (
        {"log": {"log_artifacts": "sometimes"}},
        "'log.log_artifacts' is 'sometimes'; choose one of false, end, checkpoint",
    ),
    ({"optim": "adamw_turbo"}, "Unknown optimizer 'adamw_turbo'"),
    ({"lr_scheduler_type": "zigzag"}, "Unknown lr scheduler 'zigzag'"),
    ({"strategy": "mesh"}, "Unknown strategy 'mesh'"),
    ({"precision": "fp7"}, "Unknown precision plugin 'fp7'"),
    ({"report_to": ["tensorbord"]}, "Unknown logger 'tensorbord'"),
    ({"log": {"history": ["xml"]}}, "Unknown logger 'xml'"),
    (
        {"save_strategy": "best", "metric_for_best_model": "loss"},
        "save.strategy 'best' saves when an evaluation improves the best metric, but eval.strategy is 'no'",
    ),
    ({"load_best_model_at_end": True}, "load_best_model_at_end needs evaluation during training"),
    (
        {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "epoch"},
        "needs save.strategy ('epoch') to match eval.strategy ('steps')",
    ),
    (
        {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 5},
        "save.steps (5) to be a multiple of eval.steps (3)",
    ),
    (
        {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 1},
        "save.steps (1) to be a multiple of eval.steps (3)",
    ),
    ({"save_strategy": "best"}, "`args.metric_for_best_model` must be provided when using 'best' save_strategy"),
    ({"torch_compile": {"regions": "layers"}}, "'torch_compile.regions' is 'layers'; use blocks"),
    ({"torch_compile_mode": "fastest"}, "'train.torch_compile_mode' is 'fastest', which torch.compile does not know"),
    ({"log": {"model_summary": "tree"}}, "'log.model_summary' is 'tree'; choose one of auto, table, line, off"),
    ({"log": {"model_summary_depth": -2}}, "'log.model_summary_depth' must be -1 (every module) or >= 0, got -2"),
    ({"log": {"nonfinite_window": "zero"}}, "'log.nonfinite_window' is 'zero'; choose one of nan, filtered"),
    ({"precision": {"name": "fp8", "fp8": {"recipe": "blockwise"}}}, "'precision.fp8.recipe' is 'blockwise'"),
    ({"precision": {"name": "mxfp8", "mxfp8": {"recipe": "floor"}}}, "'precision.mxfp8.recipe' is 'floor'"),
    (
        {"precision": {"name": "fp8", "fp8": {"recipe": "rowwise", "fsdp_float8_all_gather": True}}},
        "fsdp_float8_all_gather needs one scale per weight, which recipe 'rowwise' does not have",
    ),
    ({"precision": {"name": "bf16", "fp8": {"emulate": True}}}, "precision.fp8 is set but precision is 'bf16'"),
    ({"precision": {"name": "fp8", "mxfp8": {"emulate": True}}}, "precision.mxfp8 is set but precision is 'fp8'"),
    ({"train": {"loss": {"chunk_size": 0}}}, "train.loss.chunk_size is 0; it must be a positive number"),
    (
        {"train": {"loss": {"chunked": True}}, "label_smoothing_factor": 0.1},
        "train.loss.chunked cannot smooth labels",
    ),
    ({"data": {"use_seedable_sampler": False}}, "data.use_seedable_sampler=false would draw the shuffle order"),
    ({"debug": ["tpu_metrics_debug"]}, "debug 'tpu_metrics_debug' prints the XLA metrics report, but strategy is"),
    ({"torch_empty_cache_steps": 0}, "'train.torch_empty_cache_steps' must be > 0, got 0"),
    ({"dataloader_multiprocessing_context": "thread"}, "'data.dataloader_multiprocessing_context' is 'thread'"),
    ({"save": {"async": True, "async_save": False}}, "save.async (True) and save.async_save (False) are one setting"),
    ({"output_dir": ""}, "output_dir is empty ('')"),
    ({"output_dir": __file__}, "is a file, not a folder; pick another output_dir"),
]


@pytest.mark.parametrize("source, message", BAD, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s, _ in BAD])
def test_each_check_refuses_its_bad_value_in_one_sentence(source, message):
    with pytest.raises(ConfigError) as err:
        load_config(source)
    text = str(err.value)
    assert message in text
    assert "\n" not in text and text.rstrip().endswith(".")


GOOD: list[dict[str, Any]] = [
    {"warmup_ratio": 1.0},
    {"warmup_ratio": 0.0},
    {"max_grad_norm": 0.0},
    {"num_train_epochs": 0.0},
    {"max_steps": -1},
    {"dataloader_num_workers": 0},
    {"learning_rate": 0.0},
    {"weight_decay": 0.0},
    {"warmup_steps": 0},
    {"eval_steps": 0.5},
    {"save_steps": 1},
    {"logging_steps": 0.01},
    {"save_steps": 3.0},
    {"neftune_noise_alpha": 5.0},
    {"save_strategy": "best", "eval_strategy": "epoch", "metric_for_best_model": "loss"},
    {"log_level": "critical"},
    {"precision": {"full_eval": "bf16"}},
    {"half_precision_backend": "cpu_amp"},
    {"log": {"log_artifacts": "END"}},
    {"report_to": ["all"]},
    {"save_total_limit": 1},
    {"eval_accumulation_steps": 1},
    {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 6},
    {"load_best_model_at_end": True, "eval_strategy": "epoch", "save_strategy": "best"},
    {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 1, "save_steps": 7},
    {"log": {"model_summary_depth": -1}},
    {"precision": {"name": "fp8", "fp8": {"recipe": "rowwise"}}},  # all-gather unset: nothing to refuse
    {"precision": {"name": "fp8", "fp8": {"fsdp_float8_all_gather": True}}},  # tensorwise, the default recipe
    {"precision": {"name": "float8", "fp8": {"emulate": True}}},  # the alias of fp8 owns the section too
    {"precision": {"name": "mxfp8", "mxfp8": {"emulate": True}}},
    {"torch_compile": {"regions": "blocks"}},
    {"debug": ["underflow_overflow"]},
    {"dataloader_multiprocessing_context": "spawn"},
    {"label_smoothing_factor": 0.1},  # each alone: only the chunked loss with smoothing is refused
    {"train": {"loss": {"chunked": True}}},
]


@pytest.mark.parametrize("source", GOOD, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s in GOOD])
def test_boundary_values_are_accepted(source):
    load_config(source)
