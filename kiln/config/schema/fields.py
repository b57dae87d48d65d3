"""`opt`: a dataclass field with its help text, the one building block of every config section."""

from __future__ import annotations

import functools
from dataclasses import field
from typing import Any


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a help text (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(type(default), default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
