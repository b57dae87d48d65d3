"""A checkpoint's `config.yaml` is data, never a config to resolve.

Whoever can write into a checkpoint folder can put `${oc.env:AWS_SECRET_ACCESS_KEY}` in its
config.yaml; resolving it (OmegaConf does on every access) would read that variable and print it in the
"changed settings" warning. So the file is read with plain YAML safe loading, nothing is resolved, and
values are compared and shown as the text they are in the file (an interpolation stays the literal
`${oc.env:...}` string, which names a variable and holds no value)."""

from __future__ import annotations

import os
from typing import Any

from kiln.config.redact import select
from kiln.utils.errors import CheckpointError

CONFIG = "config.yaml"


def read_saved_config(checkpoint: str) -> dict[str, Any] | None:
    """The checkpoint's config.yaml as plain containers, nothing resolved; None when it has none."""
    import yaml

    path = os.path.join(checkpoint, CONFIG)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            tree = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as err:
        raise CheckpointError(f"{path} is unreadable ({type(err).__name__}).") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path} is damaged (it does not hold a mapping of settings).")
    return tree


def _text(value: Any) -> str:
    """A value as comparable text: YAML's `4` and a config's `4.0` are one setting; nothing is resolved."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return repr(value)


def changed_settings(checkpoint: str, current: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """`key 'old' -> 'new'` for each of `keys` whose value in the checkpoint's config.yaml differs from
    `current` (this run's config as it is saved: plain containers, environment values masked)."""
    saved = read_saved_config(checkpoint)
    if saved is None:
        return []
    pairs = ((key, _text(select(saved, key)), _text(select(current, key))) for key in keys)
    return [f"{key} {old} -> {new}" for key, old, new in pairs if old != new]
