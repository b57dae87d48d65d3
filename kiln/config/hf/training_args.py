"""kiln's config in Hugging Face's words: the `transformers.TrainingArguments` a run's settings make,
field by field, with HF's names and HF's defaults for what kiln's config does not hold (written as
`training_args.bin` by kiln.engine.checkpoint.hf_files). The other direction, TrainingArguments names
read into kiln's config, is kiln.config.hf.aliases and kiln.config.hf.args.

The built object skips `TrainingArguments.__post_init__` on purpose: that method sets up accelerate's
process state (a process group, the device, environment variables) and validates against this
machine's hardware, none of which a record of the settings may do in the middle of a run; the fields are
left as `__post_init__` would leave them (strategy names as HF's enums). It is built only where the
process already uses transformers: a plain PyTorch run does not pay for importing it (seconds)."""

from __future__ import annotations

import dataclasses
import enum
import sys
import typing
from typing import Any

#: kiln config keys outside kiln.config.hf.aliases.PATHS, with their TrainingArguments names
_TOP_LEVEL = {
    "output_dir": "output_dir",
    "run_name": "run_name",
    "seed": "seed",
    "data_seed": "data_seed",
    "full_determinism": "full_determinism",
    "resume_from_checkpoint": "resume_from_checkpoint",
    "scheduler.warmup_steps": "warmup_steps",
    "scheduler.kwargs": "lr_scheduler_kwargs",
    "log.report_to": "report_to",
}


def training_arguments(config: Any) -> Any:
    """A `transformers.TrainingArguments` holding `config`'s settings under HF's names (None without
    transformers)."""
    if "transformers" not in sys.modules:  # a plain PyTorch run: see the module docstring
        return None
    try:
        from transformers.training_args import TrainingArguments
    except ImportError:  # kiln runs without transformers; HF's file is then simply not written
        return None
    values = _hf_values(config)
    args = TrainingArguments.__new__(TrainingArguments)  # no __post_init__: see the module docstring
    for field in dataclasses.fields(TrainingArguments):
        if field.name in values:
            value = values[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        setattr(args, field.name, _as_enum(field, value))
    if isinstance(args.debug, str):  # HF's `debug: "a b"` is kept as a list of options
        from transformers.debug_utils import DebugOption

        args.debug = [DebugOption(option) for option in args.debug.split()]
    return args


def _hf_values(config: Any) -> dict[str, Any]:
    """HF name -> value for every setting of `config` that has a TrainingArguments field; values read
    from the environment (`${oc.env:...}`) appear masked, as in config.yaml."""
    from kiln.config.hf.aliases import PATHS
    from kiln.config.redact import config_for_saving, select

    # plain containers, read without OmegaConf: it would resolve the masks' `${oc.env:...}` again
    tree = config_for_saving(config)
    from transformers.training_args import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    values: dict[str, Any] = {}
    for key, name in [*((path, name) for name, path in PATHS.items()), *_TOP_LEVEL.items()]:
        if name not in fields or name in values:  # the first HF name of a key wins (HF's current one)
            continue
        value = select(tree, key)
        if value is None:
            continue  # unset in kiln: HF's default
        values[name] = value
    precision = select(tree, "precision.name")
    if precision in ("fp16", "bf16"):
        values[precision] = True
    ratio = select(tree, "scheduler.warmup_ratio")
    if not values.get("warmup_steps") and ratio:  # transformers 5 keeps a ratio in warmup_steps (below 1)
        values["warmup_steps"] = float(ratio)
    # what TrainingArguments.__post_init__ makes of these values, so the record reads as HF's would
    for name in ("logging_steps", "eval_steps", "save_steps"):
        if isinstance(values.get(name), float) and values[name] >= 1 and values[name].is_integer():
            values[name] = int(values[name])
    if values.get("eval_strategy") == "steps" and not values.get("eval_steps"):
        values["eval_steps"] = values.get("logging_steps")
    if values.get("report_to") in ("none", ["none"]):
        values["report_to"] = []
    if "gradient_checkpointing" in values and "activation_checkpointing" in fields:  # HF 5's name, mirrored
        values["activation_checkpointing"] = values["gradient_checkpointing"]
    return values


def _as_enum(field: dataclasses.Field, value: Any) -> Any:
    """A string for a field typed `SomeEnum | str` as HF's enum member (what `__post_init__` does); a
    name HF does not know (a kiln-only optimizer or schedule) stays a string."""
    if not isinstance(value, str):
        return value
    for kind in typing.get_args(field.type) or (field.type,):
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            try:
                return kind(value)
            except ValueError:
                return value
    return value
