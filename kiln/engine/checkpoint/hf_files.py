"""Hugging Face's files beside the weights, so that a kiln checkpoint, a `save_model` folder and a
`kiln convert` output look to Transformers' tools as HF's Trainer leaves them: `config.json` and
`generation_config.json` (`from_pretrained` builds the model from them), the tokenizer or processor
files, and `training_args.bin`.

`training_args.bin` is the run's `transformers.TrainingArguments`, pickled, as HF's Trainer writes it
into every checkpoint and `save_model` folder (tools read it back with `torch.load(path,
weights_only=False)`). It is written for those readers only. kiln itself never reads it: it is a
pickle, and loading a checkpoint never unpickles anything (docs/checkpoints.md, trust model), so a
planted `training_args.bin` is as inert as any other file kiln does not open; the COMPLETE marker
lists and checksums it like every file of the folder.

What is written: the `TrainingArguments` object the user handed to the Trainer, as HF writes
`self.args`; otherwise (a kiln config, a dict, a YAML file) one built from kiln's config, field by
field, with HF's names and HF's defaults for what kiln's config does not hold, and only where the
process already uses transformers (an HF model, tokenizer or arguments): a run of a plain PyTorch model
does not pay for importing transformers (seconds) at its first checkpoint, and has no HF reader to serve.
Without transformers nothing is written. The built object skips `TrainingArguments.__post_init__` on purpose:
that method sets up accelerate's process state (a process group, the device, environment variables)
and validates against this machine's hardware, none of which a record of the settings may do in the
middle of a run; the fields are left as `__post_init__` would leave them (strategy names as HF's enums)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import sys
import typing
from typing import Any, Optional

log = logging.getLogger(__name__)

TRAINING_ARGS = "training_args.bin"

#: kiln config keys outside kiln.config.aliases.PATHS, with their TrainingArguments names
_TOP_LEVEL = {"output_dir": "output_dir", "run_name": "run_name", "seed": "seed", "data_seed": "data_seed",
              "full_determinism": "full_determinism", "resume_from_checkpoint": "resume_from_checkpoint",
              "scheduler.warmup_steps": "warmup_steps", "scheduler.kwargs": "lr_scheduler_kwargs",
              "log.report_to": "report_to"}


def write_training_args(folder: str, config: Any, given: Any = None) -> Optional[str]:
    """Write `training_args.bin` into `folder` (the caller is the writing rank); returns its path, or
    None where transformers is not installed (or the object would not pickle: logged, not raised)."""
    import torch

    path = os.path.join(folder, TRAINING_ARGS)
    try:
        args = given if given is not None else training_arguments(config)
        if args is None:
            return None
        torch.save(args, path)
    except Exception as err:  # a record for other tools must never cost the checkpoint itself
        if os.path.exists(path):
            os.remove(path)
        log.warning("%s was not written (%s: %s); the checkpoint is complete without it.", TRAINING_ARGS,
                    type(err).__name__, err)
        return None
    return path


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
    from kiln.config.aliases import PATHS
    from kiln.config.redact import config_for_saving
    from kiln.engine.checkpoint.saved_config import select

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


#: tokenizer and processor files `save_pretrained` writes (copied by `kiln convert` when present)
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
                   "feature_extractor_config.json", "video_preprocessor_config.json")
MODEL_FILES = ("config.json", "generation_config.json")


def write_model_files(folder: str, model: Any, processing_class: Any) -> None:
    """`config.json` and `generation_config.json` of a Transformers model, and the processing class's
    files, as `save_pretrained` writes them next to the weights (HF's Trainer does in every checkpoint)."""
    to_json_file = getattr(getattr(model, "config", None), "to_json_file", None)
    if callable(to_json_file):  # Transformers: from_pretrained(checkpoint) works
        to_json_file(os.path.join(folder, "config.json"))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and hasattr(generation, "save_pretrained") and (not callable(can_generate) or can_generate()):
        try:
            generation.save_pretrained(folder)
        except ValueError as err:  # HF refuses to save an inconsistent generation config; the weights still count
            log.warning("generation_config.json was not written (%s).", err)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(folder)


def copy_model_files(source: str, target: str) -> None:
    """Copy the model and processor files `source` holds into `target`."""
    import shutil

    for name in (*MODEL_FILES, *PROCESSOR_FILES):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
