"""Whether a config comes in Hugging Face's dialect, and the settings whose default follows from it.

A `TrainingArguments` object, or a mapping (a dict, a YAML file, a JSON dump of one) that holds only
HF's flat names, is an HF user's run: where kiln's default departs from HF's on purpose, it gets HF's
instead. kiln stops a run whose loss stays nan/inf and logs nan for a window without a finite loss;
HF trains on and logs its filter's stand-in (0.0). Any kiln key (a group such as `train:`, a dotted
key, `strategy:`) makes the config kiln's, and kiln's defaults apply. A key set explicitly keeps its
value in either dialect."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kiln.config.hf import aliases

#: setting -> (kiln's default, HF's behaviour), for the settings left unset (None in the schema)
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "train.max_nonfinite_steps": (10, 0),
    "log.nonfinite_window": ("nan", "filtered"),
}

#: kiln's top-level keys that are TrainingArguments names too
_SHARED = (
    "output_dir",
    "overwrite_output_dir",
    "run_name",
    "seed",
    "data_seed",
    "full_determinism",
    "resume_from_checkpoint",
)


def _hf_name(key: str, value: Any) -> bool:
    if key in _SHARED:
        return True
    if key == "optim":  # HF's optimizer name; kiln's `optim:` group is a mapping
        return isinstance(value, str)
    if key in ("activation_checkpointing", "torch_compile"):  # HF's switches; kiln's sections are mappings
        return not isinstance(value, Mapping)
    return aliases.is_alias(key)


def is_hf_dialect(raw: Mapping[Any, Any]) -> bool:
    """Whether every key of `raw` (a config as given, before normalising) is one of HF's flat names."""
    return bool(raw) and all(_hf_name(str(key), value) for key, value in raw.items())


def fill_defaults(cfg: DictConfig, hf: bool) -> None:
    """Give each setting of DEFAULTS that no layer set the default of the config's dialect (in place)."""
    for key, (kiln_default, hf_default) in DEFAULTS.items():
        if OmegaConf.select(cfg, key) is None:
            OmegaConf.update(cfg, key, hf_default if hf else kiln_default)
