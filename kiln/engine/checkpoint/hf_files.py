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
field, with HF's names and HF's defaults for what kiln's config does not hold (kiln.config.hf.training_args
translates), and only where the
process already uses transformers (an HF model, tokenizer or arguments): a run of a plain PyTorch model
does not pay for importing transformers (seconds) at its first checkpoint, and has no HF reader to serve.
Without transformers nothing is written. The built object skips `TrainingArguments.__post_init__` on purpose:
that method sets up accelerate's process state (a process group, the device, environment variables)
and validates against this machine's hardware, none of which a record of the settings may do in the
middle of a run; the fields are left as `__post_init__` would leave them (strategy names as HF's enums)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

TRAINING_ARGS = "training_args.bin"


def write_training_args(folder: str, config: Any, given: Any = None) -> str | None:
    """Write `training_args.bin` into `folder` (the caller is the writing rank); returns its path, or
    None where transformers is not installed (or the object would not pickle: logged, not raised)."""
    import torch

    from kiln.config.hf.training_args import training_arguments

    path = os.path.join(folder, TRAINING_ARGS)
    try:
        args = given if given is not None else training_arguments(config)
        if args is None:
            return None
        torch.save(args, path)
    except Exception as err:  # a record for other tools must never cost the checkpoint itself
        if os.path.exists(path):
            os.remove(path)
        log.warning(
            "%s was not written (%s: %s); the checkpoint is complete without it.",
            TRAINING_ARGS,
            type(err).__name__,
            err,
        )
        return None
    return path


#: tokenizer and processor files `save_pretrained` writes (copied by `kiln convert` when present)
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "feature_extractor_config.json",
    "video_preprocessor_config.json",
)
MODEL_FILES = ("config.json", "generation_config.json")


def write_model_files(folder: str, model: Any, processing_class: Any) -> None:
    """`config.json` and `generation_config.json` of a Transformers model, and the processing class's
    files, as `save_pretrained` writes them next to the weights (HF's Trainer does in every checkpoint)."""
    to_json_file = getattr(getattr(model, "config", None), "to_json_file", None)
    if callable(to_json_file):  # Transformers: from_pretrained(checkpoint) works
        to_json_file(os.path.join(folder, "config.json"))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if (
        generation is not None
        and hasattr(generation, "save_pretrained")
        and (not callable(can_generate) or can_generate())
    ):
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
