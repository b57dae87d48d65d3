"""Hugging Face `TrainingArguments` as a kiln config: the object itself (`Trainer(model, args=...)`)
and the keys transformers 5 added to `TrainingArguments().to_dict()` (a JSON dump of one loads too).

The object is recognised by its class name and module, so transformers is imported only when a user
hands one over. Its `to_dict()` is the same flat-name mapping that `kiln.config.hf.aliases` already
rewrites into the tree; the functions here translate the transformers-5 keys whose values need more
than a path (`warmup_steps` as a ratio, `include_num_input_tokens_seen: "no"`, ...)."""

from __future__ import annotations

from typing import Any

# accelerate's AcceleratorConfig defaults, which kiln's own dataloaders and process group behave as
ACCELERATOR_DEFAULTS: dict[str, Any] = {
    "split_batches": False,
    "dispatch_batches": None,
    "even_batches": True,
    "use_seedable_sampler": True,
    "non_blocking": False,
    "gradient_accumulation_kwargs": None,
}


def is_training_arguments(obj: Any) -> bool:
    """True for `transformers.TrainingArguments` and its subclasses (Seq2SeqTrainingArguments, TRL's
    configs), without importing transformers."""
    return any(
        cls.__name__ == "TrainingArguments" and cls.__module__.startswith("transformers") for cls in type(obj).__mro__
    )


def training_arguments_to_dict(args: Any) -> dict[str, Any]:
    """The flat HF names and values of `args` (its `to_dict()`: enums as strings, tokens redacted)."""
    values = dict(args.to_dict())
    values.pop("hub_token", None)  # redacted ('<HUB_TOKEN>'); kiln never talks to the Hub
    return values


def warmup_steps(value: Any) -> dict[str, Any]:
    """transformers 5 folds warmup_ratio into warmup_steps: a value below 1 is a fraction of the steps."""
    if value is None:
        return {}
    if 0 < float(value) < 1:
        return {"scheduler.warmup_ratio": float(value)}
    return {"scheduler.warmup_steps": value}


def scheduler_kwargs(value: Any) -> dict[str, Any]:
    """`lr_scheduler_kwargs`: HF's default is None, and a JSON string is accepted as on HF's command line."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"lr_scheduler_kwargs must be a mapping or a JSON object, got {value!r}.") from None
    return {"scheduler.kwargs": value}


def tokens_seen(value: Any) -> dict[str, Any]:
    """`include_num_input_tokens_seen`: HF 5 takes 'no' / 'all' / 'non_padding' or a bool."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word == "non_padding":
            raise ValueError(
                "include_num_input_tokens_seen='non_padding' is not supported by kiln: it counts every "
                "input_ids element ('all'); use include_num_input_tokens_seen: all."
            )
        if word not in ("no", "all", "true", "false"):
            raise ValueError(f"include_num_input_tokens_seen must be 'no', 'all' or a boolean, got {value!r}.")
        return {"train.include_num_input_tokens_seen": word in ("all", "true")}
    return {"train.include_num_input_tokens_seen": bool(value)}
