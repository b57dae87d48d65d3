"""Flat Hugging Face `TrainingArguments` names, mapped onto kiln's config tree.

An HF user's arguments (a dict, a YAML file, or `key=value` on the command line) work unchanged: each
flat name is rewritten to its place in the tree before validation. Names that switch a whole plugin
(`fp16: true`, `deepspeed: ds.json`) are translated by small functions below."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kiln.config import trl_packing
from kiln.config.activation_checkpointing import hf_kwargs
from kiln.config.hf import args as hf_args
from kiln.config.hf import rewrites as hf_rewrites
from kiln.utils.truthy import truthy

# flat HF name -> dotted path in TrainingConfig
PATHS: dict[str, str] = {
    # train
    "num_train_epochs": "train.num_train_epochs",
    "max_steps": "train.max_steps",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "max_grad_norm": "train.max_grad_norm",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "torch_compile": "train.torch_compile",
    "torch_compile_backend": "train.torch_compile_backend",
    "torch_compile_mode": "train.torch_compile_mode",
    "torchdynamo": "train.torch_compile_backend",  # HF's older name
    "ignore_data_skip": "train.ignore_data_skip",
    "label_smoothing_factor": "train.label_smoothing_factor",
    "average_tokens_across_devices": "train.average_tokens_across_devices",
    "neftune_noise_alpha": "train.neftune_noise_alpha",
    "torch_empty_cache_steps": "train.torch_empty_cache_steps",
    "use_cache": "train.use_cache",
    # data
    "per_device_train_batch_size": "data.per_device_train_batch_size",
    "per_device_eval_batch_size": "data.per_device_eval_batch_size",
    "per_gpu_train_batch_size": "data.per_device_train_batch_size",
    "per_gpu_eval_batch_size": "data.per_device_eval_batch_size",
    "train_batch_size": "data.per_device_train_batch_size",
    "eval_batch_size": "data.per_device_eval_batch_size",
    "dataloader_num_workers": "data.dataloader_num_workers",
    "dataloader_pin_memory": "data.dataloader_pin_memory",
    "dataloader_drop_last": "data.dataloader_drop_last",
    "dataloader_persistent_workers": "data.dataloader_persistent_workers",
    "dataloader_prefetch_factor": "data.dataloader_prefetch_factor",
    "auto_find_batch_size": "data.auto_find_batch_size",
    "group_by_length": "data.group_by_length",
    "length_column_name": "data.length_column_name",
    "remove_unused_columns": "data.remove_unused_columns",
    "label_names": "data.label_names",
    "dataloader_multiprocessing_context": "data.dataloader_multiprocessing_context",
    "dataloader_in_order": "data.dataloader_in_order",
    # optim
    "optim": "optim.name",
    "learning_rate": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.adam_beta1",
    "adam_beta2": "optim.adam_beta2",
    "adam_epsilon": "optim.adam_epsilon",
    "optim_args": "optim.optim_args",
    "optim_target_modules": "optim.target_modules",
    # scheduler
    "lr_scheduler_type": "scheduler.name",
    "warmup_ratio": "scheduler.warmup_ratio",
    # eval
    "eval_strategy": "eval.strategy",
    "evaluation_strategy": "eval.strategy",
    "eval_steps": "eval.steps",
    "eval_delay": "eval.delay",
    "eval_on_start": "eval.on_start",
    "jit_mode_eval": "eval.compile",  # TorchScript is deprecated: the evaluation forward is compiled instead
    "eval_accumulation_steps": "eval.accumulation_steps",
    "prediction_loss_only": "eval.prediction_loss_only",
    "include_inputs_for_metrics": "eval.include_inputs_for_metrics",
    "eval_do_concat_batches": "eval.do_concat_batches",
    "batch_eval_metrics": "eval.batch_eval_metrics",
    "metric_for_best_model": "eval.metric_for_best_model",
    "greater_is_better": "eval.greater_is_better",
    "load_best_model_at_end": "eval.load_best_model_at_end",
    "predict_with_generate": "eval.predict_with_generate",
    "generation_max_length": "eval.generation_max_length",
    "generation_num_beams": "eval.generation_num_beams",
    # save
    "save_strategy": "save.strategy",
    "save_steps": "save.steps",
    "save_total_limit": "save.total_limit",
    "save_only_model": "save.only_model",
    "save_safetensors": "save.safetensors",
    "save_on_each_node": "save.on_each_node",
    "restore_callback_states_from_checkpoint": "save.restore_callback_states_from_checkpoint",
    "enable_jit_checkpoint": "save.on_preemption",
    "eval_use_gather_object": "eval.use_gather_object",
    # log
    "logging_strategy": "log.strategy",
    "logging_steps": "log.steps",
    "logging_first_step": "log.first_step",
    "logging_nan_inf_filter": "log.nan_inf_filter",
    "logging_dir": "log.logging_dir",
    "log_level": "log.level",
    "log_level_replica": "log.level_replica",
    "log_on_each_node": "log.on_each_node",
    "disable_tqdm": "log.disable_tqdm",
    "skip_memory_metrics": "log.skip_memory_metrics",
    "include_tokens_per_second": "log.include_tokens_per_second",
    # strategy
    "ddp_backend": "strategy.backend",
    "ddp_timeout": "strategy.timeout",
    "ddp_find_unused_parameters": "strategy.find_unused_parameters",
    "ddp_bucket_cap_mb": "strategy.bucket_cap_mb",
    "ddp_broadcast_buffers": "strategy.broadcast_buffers",
    # precision
    "tf32": "precision.tf32",
    "fp16_opt_level": "precision.fp16_opt_level",
    "half_precision_backend": "precision.half_precision_backend",
    "fp16_backend": "precision.half_precision_backend",
}

# HF arguments that the Trainer itself does not use (scripts read them) or that only matter for a
# feature that is off (hub settings without push_to_hub); accepted and dropped.
IGNORED = {
    "do_train",
    "do_eval",
    "do_predict",
    "local_rank",
    "tpu_num_cores",
    "ray_scope",
    # HF's `project` is only read by Trackio, and defaults to "huggingface": kiln's trackers use log.project
    "project",
    "hub_model_id",
    "hub_strategy",
    "hub_token",
    "hub_private_repo",
    "hub_always_push",
    "hub_revision",
    "push_to_hub_model_id",
    "push_to_hub_organization",
    "push_to_hub_token",
}

# HF arguments kiln does not implement: accepted while off (their HF default), refused with the reason
# and the alternative when switched on.
UNSUPPORTED = {
    "use_ipex": "use bf16 and torch_compile for the CPU speed-ups instead of Intel Extension for PyTorch",
    **{
        name: "Liger's Triton kernels need the liger-kernel package and a CUDA GPU, and kiln does not apply them; for "
        "the loss without the full logits use train.loss: {chunked: true} (kiln's chunked loss, on any device, "
        "also the CPU), and torch_compile to fuse the other layers"
        for name in ("use_liger_kernel", "liger_kernel_config")
    },
    "past_index": "transformers 5 removed it with the TransformerXL-style models that read `mems`; drop past_index",
    "use_legacy_prediction_loop": "there is one prediction loop; drop use_legacy_prediction_loop",
    "sharded_ddp": "FairScale sharded DDP is gone from HF too; use strategy: fsdp or deepspeed",
    "mp_parameters": "SageMaker model parallelism is not available",
    **{
        name: "kiln logs Trackio to its local database only (report_to: trackio); drop the Space and bucket settings"
        for name in ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")
    },
}

# HF arguments that HF itself accepts and ignores: accepted with any value, and one log line says it has
# no effect when it is switched on (dropping it silently would hide that it does nothing)
NO_EFFECT = {
    "sortish_sampler": "HF's Seq2SeqTrainer ignores it too (it served the old Seq2SeqDataset); group_by_length: "
    "true gives batches of similar length, shuffled",
}


def _no_effect(name: str) -> Callable[[Any], dict[str, Any]]:
    def note(value: Any) -> dict[str, Any]:
        if truthy(value):
            logging.getLogger(__name__).warning("%s=%r has no effect: %s.", name, value, NO_EFFECT[name])
        return {}

    return note


# the value each UNSUPPORTED name holds while off, where that is not None / False / empty
_OFF = {"past_index": -1, "dataloader_in_order": True}


def _unsupported(name: str) -> Callable[[Any], dict[str, Any]]:
    def refuse(value: Any) -> dict[str, Any]:
        if name in _OFF:
            off = value is None or value == _OFF[name]
        else:
            off = value is None or value is False or value in ("", [], {})
        if not off:
            raise ValueError(f"{name}={value!r} is not supported by kiln: {UNSUPPORTED[name]}.")
        return {}

    return refuse


def _flag(path: str, value_if_true: Any) -> Callable[[Any], dict[str, Any]]:
    def rewrite(value: Any) -> dict[str, Any]:
        return {path: value_if_true} if truthy(value) else {}

    return rewrite


def _deepspeed(value: Any) -> dict[str, Any]:
    return {"strategy.name": "deepspeed", "strategy.options.config": value} if value else {}


def _fsdp(value: Any) -> dict[str, Any]:
    if not value:
        return {}
    flags = value.split() if isinstance(value, str) else list(value) if not isinstance(value, bool) else []
    return {"strategy.name": "fsdp", "strategy.options.fsdp": flags}


def _report_to(value: Any) -> dict[str, Any]:
    names = (
        [value] if isinstance(value, str) else list(value) if isinstance(value, Sequence) else None
    )  # ListConfig too
    if names is None or not all(isinstance(name, str) for name in names):
        raise ValueError(
            f"report_to is {value!r}; give a tracker name or a list of them (tensorboard, mlflow, wandb, comet_ml, "
            "clearml, dvclive, aim, trackio, swanlab, codecarbon, neptune, csv, jsonl, all or none)."
        )
    return {"log.report_to": names}


def _use_cpu(value: Any) -> dict[str, Any]:
    return {"strategy.device": "cpu"} if truthy(value) else {}


def _push_to_hub(value: Any) -> dict[str, Any]:
    if truthy(value):
        raise ValueError(
            "push_to_hub is not supported: kiln runs offline. Save with trainer.save_model() and upload the folder yourself."
        )
    return {}


# flat HF name -> function returning {dotted path: value}
REWRITES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "fp16": _flag("precision.name", "fp16"),
    "bf16": _flag("precision.name", "bf16"),
    "fp16_full_eval": _flag("precision.full_eval", "fp16"),
    "bf16_full_eval": _flag("precision.full_eval", "bf16"),
    "adafactor": _flag("optim.name", "adafactor"),
    "use_cpu": _use_cpu,
    "no_cuda": _use_cpu,
    "deepspeed": _deepspeed,
    "fsdp": _fsdp,
    "fsdp_config": lambda v: {"strategy.options.fsdp_config": v} if v else {},
    # older HF top-level forms of two fsdp_config keys
    "fsdp_min_num_params": lambda v: {"strategy.options.min_num_params": int(v)} if v else {},
    "fsdp_transformer_layer_cls_to_wrap": lambda v: (
        {"strategy.options.wrap": [v] if isinstance(v, str) else list(v)} if v else {}
    ),
    "report_to": _report_to,
    "push_to_hub": _push_to_hub,
    # transformers 5 names whose values need translating (kiln.config.hf.args, kiln.config.hf.rewrites)
    "activation_checkpointing": _flag("train.gradient_checkpointing", True),
    **{name: hf_kwargs(name) for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")},
    "warmup_steps": hf_args.warmup_steps,
    "lr_scheduler_kwargs": hf_args.scheduler_kwargs,
    "include_num_input_tokens_seen": hf_args.tokens_seen,
    **hf_rewrites.REWRITES,
    **trl_packing.REWRITES,  # TRL's SFTConfig names for data.packing
    **{name: _unsupported(name) for name in UNSUPPORTED},
    **{name: _no_effect(name) for name in NO_EFFECT},
}


def is_alias(name: str) -> bool:
    return name in PATHS or name in REWRITES or name in IGNORED


def rewrite(name: str, value: Any) -> dict[str, Any]:
    """Turn one flat HF `name: value` into `{dotted.path: value}` entries for the tree."""
    if name in IGNORED:
        return {}
    if name in REWRITES:
        return REWRITES[name](value)
    return {PATHS[name]: value}
