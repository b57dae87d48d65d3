"""The one reading of a yes/no setting that may arrive as text (environment variables, HF's
`fsdp_config` values, command-line overrides): "1", "true", "yes", "on" in any case are true."""

from __future__ import annotations

from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on"})


def truthy(value: Any) -> bool:
    """Whether `value` means yes: a string from the set above, otherwise its plain truth value."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)
