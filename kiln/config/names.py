"""The names a config may give for each plug-in kind: the config's vocabulary, as HF's TrainingArguments
holds `OptimizerNames` and `SchedulerType`.

Validation refuses an unknown name before any work starts, and it must do so without importing (or
naming) the floors that implement the names: they import config, so that would run up a floor. So the
built-in names sit here as data; the floors register an implementation for each of them
(tests/config/test_names.py checks that both sides list the same names), and a name registered at run
time (`OPTIMIZERS.add("lion", ...)`) is read from the registry its floor published in kiln.registry."""

from __future__ import annotations

from kiln.registry import Registry, published_names

#: the strategy names, in groups of aliases (a group is one class, or one family of presets)
STRATEGY_GROUPS: tuple[tuple[str, ...], ...] = (
    ("single", "cpu", "cuda"),
    ("ddp", "ddp_find_unused_parameters_true"),
    ("fsdp", "fsdp2"),
    ("model_parallel",),
    (
        "deepspeed",
        "deepspeed_stage_1",
        "deepspeed_stage_2",
        "deepspeed_stage_3",
        "deepspeed_stage_2_offload",
        "deepspeed_stage_3_offload",
    ),
    ("xla",),
    ("xla_fsdp",),
    ("mps",),
    ("auto",),
)

#: the precision plugin names, in groups of aliases (one plugin each)
PRECISION_GROUPS: tuple[tuple[str, ...], ...] = (
    ("fp32", "32", "32-true", "no"),
    ("fp16", "16-mixed", "16", "bf16", "bf16-mixed"),
    ("fp16-true", "16-true", "bf16-true"),
    ("apex",),
    ("tf32",),
    ("fp8", "float8"),
    ("mxfp8",),
)

#: torchao's float8 scaling recipes (`precision.fp8.recipe`)
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: torchao's MXFP8 recipes (`precision.mxfp8.recipe`)
MXFP8_RECIPES: tuple[str, ...] = ("rceil", "rceil_wgrad_with_hp")

OPTIMIZER_NAMES: tuple[str, ...] = (
    "adafactor",
    "adagrad",
    "adalomo",
    "adam",
    "adamw_8bit",
    "adamw_anyprecision",
    "adamw_apex_fused",
    "adamw_bnb_8bit",
    "adamw_hf",
    "adamw_torch",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "adamw_torch_foreach",
    "adamw_torch_fused",
    "adamw_torch_npu_fused",
    "adamw_torch_xla",
    "ademamix",
    "ademamix_8bit",
    "apollo_adamw",
    "apollo_adamw_layerwise",
    "galore_adafactor",
    "galore_adafactor_layerwise",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adamw_8bit_layerwise",
    "galore_adamw_layerwise",
    "grokadamw",
    "lion_32bit",
    "lion_8bit",
    "lomo",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop",
    "rmsprop_bnb",
    "rmsprop_bnb_32bit",
    "rmsprop_bnb_8bit",
    "schedule_free_adamw",
    "schedule_free_radam",
    "schedule_free_sgd",
    "sgd",
    "stable_adamw",
)

SCHEDULER_NAMES: tuple[str, ...] = (
    "constant",
    "constant_with_warmup",
    "cosine",
    "cosine_warmup_with_min_lr",
    "cosine_with_min_lr",
    "cosine_with_restarts",
    "greedy",
    "inverse_sqrt",
    "linear",
    "polynomial",
    "reduce_lr_on_plateau",
    "warmup_stable_decay",
)

#: the loggers `report_to` may name (besides `all` and `none`)
LOGGER_NAMES: tuple[str, ...] = (
    "csv",
    "jsonl",
    "tensorboard",
    "mlflow",
    "wandb",
    "comet_ml",
    "clearml",
    "dvclive",
    "aim",
    "trackio",
    "swanlab",
    "codecarbon",
    "neptune",
)

#: config key -> (the word an error uses, the built-in names)
VOCABULARY: dict[str, tuple[str, tuple[str, ...]]] = {
    "strategy.name": ("strategy", tuple(name for group in STRATEGY_GROUPS for name in group)),
    "precision.name": ("precision plugin", tuple(name for group in PRECISION_GROUPS for name in group)),
    "optim.name": ("optimizer", OPTIMIZER_NAMES),
    "scheduler.name": ("lr scheduler", SCHEDULER_NAMES),
    "log.report_to": ("logger", LOGGER_NAMES),
}


def check_name(config_key: str, name: str) -> None:
    """Raise UnknownNameError (with the valid names, and the closest one) unless `name` is a built-in
    name for `config_key` or one registered at run time in the registry published for that key."""
    kind, builtin = VOCABULARY[config_key]
    names: Registry[object] = Registry(kind, config_key)
    for entry in (*builtin, *published_names(config_key)):
        names.add_lazy(entry, "")
    names.check(name)
