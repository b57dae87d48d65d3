"""What kiln writes and logs of a config: values that came from `${oc.env:VAR}` appear as that
interpolation, never as the value itself.

kiln resolves a config once, when it is loaded (settings travel in the config objects, not through
the environment), so the interpolation strings are gone from the tree that training reads. Tokens and
passwords are passed as `${oc.env:VAR}` precisely so that they stay out of files; without this,
every checkpoint's config.yaml, the exported kiln_config.yaml and the trackers' hyperparameters would
hold them in clear text. So the loader remembers each environment value it resolved (`remember`), and
`config_for_saving` is the one function every writer and logger of the config calls: it masks those
values wherever they appear in a string, as CI systems mask registered secrets. A saved config
therefore still resolves to the same run where the same variables are set.

Credentials written into `save.storage_options` as they are (an S3 `secret`, a GCS `token`) are hidden
too: every value under a key that names a secret reads `<hidden>` in what is saved and logged."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

_ENV = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")
# A value this short is masked only where it is the whole string: `${oc.env:NPROC}` = "2" must not turn
# every "2" inside other strings (an output_dir "run2") into an interpolation.
_MIN_SUBSTRING = 6
_MASKS: dict[str, str] = {}  # resolved value -> the interpolation that produced it
#: keys of save.storage_options whose values are credentials (s3fs, gcsfs, adlfs, botocore's client_kwargs)
_SECRET_KEY = re.compile(r"key|secret|token|password|credential|sas|connection_string", re.IGNORECASE)
HIDDEN = "<hidden>"


def remember(raw: Any) -> None:
    """Note the environment values that the `${oc.env:VAR}` interpolations in `raw` (an unresolved
    tree of dicts, lists and strings, or one string) resolve to, so that savers can mask them."""
    if isinstance(raw, str):
        for name in _ENV.findall(raw):
            value = os.environ.get(name)  # unset: the interpolation's default, written in the config itself
            if value:
                _MASKS[value] = "${oc.env:" + name + "}"
    elif isinstance(raw, Mapping):
        for value in raw.values():
            remember(value)
    elif isinstance(raw, (list, tuple)):
        for value in raw:
            remember(value)


def mask(value: Any) -> Any:
    """`value` (a tree or a scalar) with every remembered environment value replaced by its
    interpolation; non-string leaves are returned as they are."""
    if isinstance(value, str):
        if not _MASKS:
            return value
        if value in _MASKS:
            return _MASKS[value]
        for secret in sorted(_MASKS, key=len, reverse=True):  # longest first: one value may contain another
            if len(secret) >= _MIN_SUBSTRING and secret in value:
                value = value.replace(secret, _MASKS[secret])
        return value
    if isinstance(value, Mapping):
        return {key: mask(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask(item) for item in value]
    return value


def env_names(value: Any) -> list[str]:
    """The environment variables whose remembered values `value` (a string) holds, in order."""
    return _ENV.findall(mask(value)) if isinstance(value, str) else []


def config_for_saving(config: Any) -> dict[str, Any]:
    """The config as plain containers, ready for `OmegaConf.save`, YAML or a tracker's hyperparameters:
    resolved, except that values taken from the environment read `${oc.env:VAR}` again."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(config, DictConfig):
        tree = OmegaConf.to_container(config, resolve=True)
    elif isinstance(config, Mapping):
        tree = dict(config)
    else:
        raise TypeError(f"config_for_saving takes a DictConfig or a mapping, not {type(config).__name__}.")
    tree = mask(tree)
    save = tree.get("save")
    if isinstance(save, dict) and save.get("storage_options"):
        save["storage_options"] = hide_secrets(save["storage_options"])
    return tree


def hide_secrets(options: Any) -> Any:
    """`options` (fsspec storage options) with the value of every key that names a secret replaced by
    HIDDEN, at any depth."""
    if isinstance(options, Mapping):
        return {
            k: HIDDEN if isinstance(k, str) and _SECRET_KEY.search(k) and v is not None else hide_secrets(v)
            for k, v in options.items()
        }
    if isinstance(options, (list, tuple)):
        return [hide_secrets(v) for v in options]
    return options


def select(tree: Any, key: str) -> Any:
    """The value at the dotted `key` of a tree of dicts (None where a part is missing)."""
    for part in key.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree
