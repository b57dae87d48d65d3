"""Every Hugging Face TrainingArguments name kiln accepts, written out by hand here (HF name -> kiln
path -> value), NOT read from kiln/config/hf/aliases.py: a test derived from the mapping would agree with
a wrong mapping. Each row checks that the loaded config differs from the baseline in exactly that
path (so a name mapped to a neighbouring key fails), and a few rows are followed through the Trainer
to their observable effect. The last test only checks that this table misses no alias."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from kiln import Trainer
from kiln.config import ConfigError, load_config
from tests.helpers import base_config, regression_data

# (HF name, value, {kiln path: expected value}, settings both configs share so the value validates)
TABLE: list[tuple[str, Any, dict[str, Any], dict[str, Any]]] = [
    # train
    ("num_train_epochs", 2.0, {"train.num_train_epochs": 2.0}, {}),
    ("max_steps", 7, {"train.max_steps": 7}, {}),
    ("gradient_accumulation_steps", 3, {"train.gradient_accumulation_steps": 3}, {}),
    ("max_grad_norm", 0.5, {"train.max_grad_norm": 0.5}, {}),
    ("gradient_checkpointing", True, {"train.gradient_checkpointing": True}, {}),
    (
        "gradient_checkpointing_kwargs",
        {"use_reentrant": False},
        {"train.gradient_checkpointing_kwargs": {"use_reentrant": False}},
        {},
    ),
    ("torch_compile", True, {"train.torch_compile": True}, {}),
    ("torch_compile_backend", "aot_eager", {"train.torch_compile_backend": "aot_eager"}, {}),
    ("torch_compile_mode", "reduce-overhead", {"train.torch_compile_mode": "reduce-overhead"}, {}),
    ("torchdynamo", "eager", {"train.torch_compile_backend": "eager"}, {}),
    ("ignore_data_skip", True, {"train.ignore_data_skip": True}, {}),
    ("label_smoothing_factor", 0.1, {"train.label_smoothing_factor": 0.1}, {}),
    ("include_num_input_tokens_seen", True, {"train.include_num_input_tokens_seen": True}, {}),
    ("average_tokens_across_devices", False, {"train.average_tokens_across_devices": False}, {}),
    ("neftune_noise_alpha", 5.0, {"train.neftune_noise_alpha": 5.0}, {}),
    # data
    ("per_device_train_batch_size", 3, {"data.per_device_train_batch_size": 3}, {}),
    # TRL's SFTConfig names for data.packing (tests/config/test_trl_packing.py has their pairing rules)
    ("packing", True, {"data.packing.strategy": "bfd"}, {}),
    ("packing_strategy", "wrapped", {"data.packing.strategy": "wrapped"}, {"packing": True}),
    ("padding_free", True, {"data.packing.padding_free": True}, {}),
    ("max_length", 64, {"data.packing.max_length": 64}, {"packing": True}),
    ("max_seq_length", 64, {"data.packing.max_length": 64}, {"packing": True}),
    ("per_device_eval_batch_size", 5, {"data.per_device_eval_batch_size": 5}, {}),
    ("per_gpu_train_batch_size", 6, {"data.per_device_train_batch_size": 6}, {}),
    ("per_gpu_eval_batch_size", 7, {"data.per_device_eval_batch_size": 7}, {}),
    ("train_batch_size", 9, {"data.per_device_train_batch_size": 9}, {}),
    ("eval_batch_size", 10, {"data.per_device_eval_batch_size": 10}, {}),
    ("dataloader_num_workers", 2, {"data.dataloader_num_workers": 2}, {}),
    ("dataloader_pin_memory", False, {"data.dataloader_pin_memory": False}, {}),
    ("dataloader_drop_last", True, {"data.dataloader_drop_last": True}, {}),
    ("dataloader_persistent_workers", True, {"data.dataloader_persistent_workers": True}, {}),
    ("dataloader_prefetch_factor", 4, {"data.dataloader_prefetch_factor": 4}, {}),
    ("auto_find_batch_size", True, {"data.auto_find_batch_size": True}, {}),
    ("group_by_length", True, {"data.group_by_length": True}, {}),
    ("length_column_name", "n_tokens", {"data.length_column_name": "n_tokens"}, {}),
    ("remove_unused_columns", False, {"data.remove_unused_columns": False}, {}),
    ("label_names", ["y"], {"data.label_names": ["y"]}, {}),
    # optim
    ("optim", "sgd", {"optim.name": "sgd"}, {}),
    ("learning_rate", 0.3, {"optim.lr": 0.3}, {}),
    ("weight_decay", 0.01, {"optim.weight_decay": 0.01}, {}),
    ("adam_beta1", 0.8, {"optim.adam_beta1": 0.8}, {}),
    ("adam_beta2", 0.95, {"optim.adam_beta2": 0.95}, {}),
    ("adam_epsilon", 1e-6, {"optim.adam_epsilon": 1e-6}, {}),
    ("optim_args", "momentum=0.9", {"optim.optim_args": "momentum=0.9"}, {}),
    ("adafactor", True, {"optim.name": "adafactor"}, {}),
    # scheduler
    ("lr_scheduler_type", "cosine", {"scheduler.name": "cosine"}, {}),
    ("lr_scheduler_kwargs", {"num_cycles": 2}, {"scheduler.kwargs": {"num_cycles": 2}}, {}),
    ("warmup_steps", 4, {"scheduler.warmup_steps": 4}, {}),
    ("warmup_ratio", 0.2, {"scheduler.warmup_ratio": 0.2}, {}),
    # eval
    ("eval_strategy", "steps", {"eval.strategy": "steps"}, {}),
    ("evaluation_strategy", "epoch", {"eval.strategy": "epoch"}, {}),
    ("eval_steps", 3, {"eval.steps": 3}, {}),
    ("eval_delay", 2, {"eval.delay": 2}, {}),
    ("eval_on_start", True, {"eval.on_start": True}, {}),
    ("eval_accumulation_steps", 4, {"eval.accumulation_steps": 4}, {}),
    ("prediction_loss_only", True, {"eval.prediction_loss_only": True}, {}),
    ("include_inputs_for_metrics", True, {"eval.include_inputs_for_metrics": True}, {}),
    ("eval_do_concat_batches", False, {"eval.do_concat_batches": False}, {}),
    ("batch_eval_metrics", True, {"eval.batch_eval_metrics": True}, {}),
    ("metric_for_best_model", "accuracy", {"eval.metric_for_best_model": "accuracy"}, {}),
    ("greater_is_better", False, {"eval.greater_is_better": False}, {}),
    ("load_best_model_at_end", True, {"eval.load_best_model_at_end": True}, {"eval": {"strategy": "steps"}}),
    ("predict_with_generate", True, {"eval.predict_with_generate": True}, {}),
    ("generation_max_length", 64, {"eval.generation_max_length": 64}, {}),
    ("generation_num_beams", 4, {"eval.generation_num_beams": 4}, {}),
    # save
    ("save_strategy", "epoch", {"save.strategy": "epoch"}, {}),
    ("save_steps", 100, {"save.steps": 100}, {}),
    ("save_total_limit", 2, {"save.total_limit": 2}, {}),
    ("save_only_model", True, {"save.only_model": True}, {}),
    ("save_safetensors", False, {"save.safetensors": False}, {}),
    ("save_on_each_node", True, {"save.on_each_node": True}, {}),
    ("restore_callback_states_from_checkpoint", True, {"save.restore_callback_states_from_checkpoint": True}, {}),
    # log
    ("logging_strategy", "epoch", {"log.strategy": "epoch"}, {}),
    ("logging_steps", 10, {"log.steps": 10}, {}),
    ("logging_first_step", True, {"log.first_step": True}, {}),
    ("logging_nan_inf_filter", False, {"log.nan_inf_filter": False}, {}),  # effect: tests/engine/test_nan_inf_filter.py
    ("logging_dir", "tb", {"log.logging_dir": "tb"}, {}),
    ("log_level", "info", {"log.level": "info"}, {}),
    ("log_level_replica", "error", {"log.level_replica": "error"}, {}),
    ("log_on_each_node", False, {"log.on_each_node": False}, {}),
    ("disable_tqdm", True, {"log.disable_tqdm": True}, {}),
    ("skip_memory_metrics", False, {"log.skip_memory_metrics": False}, {}),
    ("include_tokens_per_second", True, {"log.include_tokens_per_second": True}, {}),
    ("report_to", "tensorboard", {"log.report_to": ["tensorboard"]}, {}),
    # strategy
    ("ddp_backend", "gloo", {"strategy.backend": "gloo"}, {}),
    ("ddp_timeout", 60, {"strategy.timeout": 60}, {}),
    ("ddp_find_unused_parameters", False, {"strategy.find_unused_parameters": False}, {}),
    ("ddp_bucket_cap_mb", 50, {"strategy.bucket_cap_mb": 50}, {}),
    ("ddp_broadcast_buffers", False, {"strategy.broadcast_buffers": False}, {}),
    ("use_cpu", True, {"strategy.device": "cpu"}, {}),
    ("no_cuda", True, {"strategy.device": "cpu"}, {}),
    ("deepspeed", "ds.json", {"strategy.name": "deepspeed", "strategy.options": {"config": "ds.json"}}, {}),
    (
        "fsdp",
        "full_shard auto_wrap",
        {"strategy.name": "fsdp", "strategy.options": {"fsdp": ["full_shard", "auto_wrap"]}},
        {},
    ),
    ("fsdp_config", {"min_num_params": 10}, {"strategy.options": {"fsdp_config": {"min_num_params": 10}}}, {}),
    (
        "parallelism_config",
        {"dp_shard_size": 2, "tp_size": 2},
        {"strategy.name": "model_parallel", "strategy.options": {"mesh": {"dp_shard": 2, "tp": 2}}},
        {},
    ),
    # precision
    ("fp16", True, {"precision.name": "fp16"}, {}),
    ("bf16", True, {"precision.name": "bf16"}, {}),
    ("fp16_full_eval", True, {"precision.full_eval": "fp16"}, {}),
    ("bf16_full_eval", True, {"precision.full_eval": "bf16"}, {}),
    ("tf32", False, {"precision.tf32": False}, {}),
    ("fp16_opt_level", "O2", {"precision.fp16_opt_level": "O2"}, {}),
    ("half_precision_backend", "cpu_amp", {"precision.half_precision_backend": "cpu_amp"}, {}),
    ("fp16_backend", "cpu_amp", {"precision.half_precision_backend": "cpu_amp"}, {}),
    # HF names implemented after this table was first written (issues 15, 16, 19, FSDP)
    ("use_mps_device", True, {"strategy.name": "mps"}, {}),
    ("optim_target_modules", ["attn"], {"optim.target_modules": ["attn"]}, {}),
    ("debug", "underflow_overflow", {"train.debug": ["underflow_overflow"]}, {}),
    ("accelerator_config", {"split_batches": True}, {"data.split_batches": True}, {}),
    ("split_batches", True, {"data.split_batches": True}, {}),
    ("dispatch_batches", True, {"data.dispatch_batches": True}, {}),
    ("even_batches", False, {"data.even_batches": False}, {}),
    ("use_seedable_sampler", True, {}, {}),  # what kiln's sampler always is; False is refused below
    ("activation_checkpointing", True, {"train.gradient_checkpointing": True}, {}),
    (
        "activation_checkpointing_kwargs",
        {"use_reentrant": False},
        {"train.gradient_checkpointing_kwargs": {"use_reentrant": False}},
        {},
    ),
    ("dataloader_in_order", True, {}, {}),  # kiln's batches always arrive in order
    ("dataloader_multiprocessing_context", "spawn", {"data.dataloader_multiprocessing_context": "spawn"}, {}),
    ("torch_empty_cache_steps", 5, {"train.torch_empty_cache_steps": 5}, {}),
    ("use_cache", False, {"train.use_cache": False}, {}),
    ("ddp_static_graph", True, {"strategy.static_graph": True}, {}),
    ("generation_config", {"max_new_tokens": 5}, {"eval.generation_kwargs": {"max_new_tokens": 5}}, {}),
    ("include_for_metrics", ["inputs"], {"eval.include_inputs_for_metrics": True}, {}),
    ("train_sampling_strategy", "group_by_length", {"data.group_by_length": True}, {}),
    ("fsdp_min_num_params", 100, {"strategy.options": {"min_num_params": 100}}, {}),
    ("fsdp_transformer_layer_cls_to_wrap", "Block", {"strategy.options": {"wrap": ["Block"]}}, {}),
    ("enable_jit_checkpoint", True, {"save.on_preemption": True}, {}),
    ("jit_mode_eval", True, {"eval.compile": True}, {}),
    ("eval_use_gather_object", True, {"eval.use_gather_object": True}, {}),
]

# accepted and dropped: scripts read them, the Trainer does not (or a feature that is off)
IGNORED = [
    "do_train",
    "do_eval",
    "do_predict",
    "local_rank",
    "tpu_num_cores",
    "ray_scope",
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
    "sortish_sampler",
]

# not implemented: accepted while off, refused (naming the argument) when on
REFUSED_WHEN_ON = {
    "use_ipex": True,
    "use_liger_kernel": True,
    "liger_kernel_config": {"rms_norm": True},
    "past_index": 2,
    "tpu_metrics_debug": True,  # the XLA metrics report: refused without an XLA strategy
    "use_legacy_prediction_loop": True,
    "sharded_ddp": "simple",
    "mp_parameters": "x",
    "push_to_hub": True,
    "eval_packing": True,  # TRL's: kiln packs training batches only
    # kiln logs Trackio locally: a Space or bucket to log to is refused, not silently dropped
    "trackio_space_id": "me/space",
    "trackio_bucket_id": "me/bucket",
    "trackio_static_space_id": "me/static",
}
OFF = {"past_index": -1, "mp_parameters": "", "liger_kernel_config": None, "sharded_ddp": ""}


def _plain(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def _diff(a: Any, b: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted path: value in b} where b differs from a (dicts compared key by key, the rest whole)."""
    out: dict[str, Any] = {}
    for key in sorted(set(a) | set(b)):
        path = f"{prefix}{key}"
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict) and key != "options" and not path.endswith("kwargs"):
            out.update(_diff(x, y, path + "."))
        elif x != y:
            out[path] = y
    return out


#: `seed` at its default is a name HF shares: with it the baseline is in HF's dialect as the rows are
#: (kiln.config.hf.dialect: a config of HF's flat names only gets HF's behaviour on nan/inf losses)
HF_BASELINE = {"seed": 42}


@pytest.mark.parametrize("name, value, expected, shared", TABLE, ids=[row[0] for row in TABLE])
def test_hf_name_lands_on_exactly_its_kiln_path(name, value, expected, shared):
    baseline = _plain(load_config({**HF_BASELINE, **shared}))
    loaded = _plain(load_config({**HF_BASELINE, **shared, name: value}))
    assert _diff(baseline, loaded) == expected


@pytest.mark.parametrize("name", IGNORED)
def test_ignored_names_change_nothing(name):
    assert _plain(load_config({name: "x" if name.startswith(("hub", "push")) else True})) == _plain(
        load_config(HF_BASELINE)
    )


@pytest.mark.parametrize("name", list(REFUSED_WHEN_ON))
def test_unimplemented_names_are_refused_when_on_and_accepted_when_off(name):
    with pytest.raises((ConfigError, ValueError)) as err:
        load_config({name: REFUSED_WHEN_ON[name]})
    assert name in str(err.value) and "\n" not in str(err.value)
    assert _plain(load_config({name: OFF.get(name, False)})) == _plain(load_config(HF_BASELINE))


# -- observable effects through the Trainer ---------------------------------------------------------
@pytest.mark.parametrize(
    "name, key",
    [
        ("per_gpu_train_batch_size", "train"),
        ("train_batch_size", "train"),
        ("per_gpu_eval_batch_size", "eval"),
        ("eval_batch_size", "eval"),
    ],
)
def test_batch_size_aliases_set_the_batches(tmp_path, name, key):
    trainer = Trainer(
        nn.Linear(2, 1),
        {**base_config(tmp_path), name: 3},
        train_dataset=regression_data(10, d_in=2),
        eval_dataset=regression_data(10, d_in=2),
    )
    loader = trainer.get_train_dataloader() if key == "train" else trainer.get_eval_dataloader()
    assert [len(b["y"]) for b in loader] == [3, 3, 3, 1]


class Classifier(nn.Module):
    """HF contract: returns logits (and an unsmoothed loss, which label smoothing must replace)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        logits = self.head(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def test_label_smoothing_factor_smooths_the_training_loss(tmp_path):
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=g), "labels": torch.randint(0, 5, (8,), generator=g)}
    model = Classifier()
    trainer = Trainer(model, {**base_config(tmp_path), "label_smoothing_factor": 0.2})
    expected = F.cross_entropy(model.head(batch["x"]), batch["labels"], label_smoothing=0.2)
    assert torch.allclose(trainer.compute_loss(model, batch), expected)
    assert not torch.allclose(expected, F.cross_entropy(model.head(batch["x"]), batch["labels"]))


def test_fp16_backend_picks_the_half_precision_backend(tmp_path):
    """fp16_backend=cuda_amp insists on a CUDA device: on the CPU the run is refused, naming the setting."""
    from kiln.precision.base import PrecisionError

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a CPU-only machine")
    with pytest.raises(PrecisionError, match="half_precision_backend is 'cuda_amp', which needs a cuda device"):
        Trainer(nn.Linear(2, 1), {**base_config(tmp_path), "bf16": True, "fp16_backend": "cuda_amp"})
    Trainer(nn.Linear(2, 1), {**base_config(tmp_path), "bf16": True, "fp16_backend": "cpu_amp"})  # accepted


def test_the_table_covers_every_alias():
    """The only use of aliases.py here: every name it accepts must have a hand-written row above."""
    from kiln.config.hf import aliases

    covered = {row[0] for row in TABLE} | set(IGNORED) | set(REFUSED_WHEN_ON)
    accepted = set(aliases.PATHS) | set(aliases.REWRITES) | set(aliases.IGNORED)
    assert accepted - covered == set(), "new HF aliases need a row in this table"
    assert covered - accepted == set()
