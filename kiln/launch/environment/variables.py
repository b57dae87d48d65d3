"""The environment variables kiln touches outside a launcher's topology (which the cluster kinds read):
the import path, for an import error's sentence, and defaults for libraries that take a setting only from
the environment. kiln's own settings travel in the config; these are how some of them reach such a
library (cuBLAS's workspace for deterministic matmuls, DeepSpeed's accelerator and local rank)."""

from __future__ import annotations

import os

from kiln.launch.environment.base import Env, current


def python_path(env: Env | None = None) -> str | None:
    """`PYTHONPATH` as the user set it (None when unset or empty), for error messages."""
    return current(env).get("PYTHONPATH") or None


def export_default(name: str, value: str) -> bool:
    """Set `name` to `value` for a library that reads it from the environment, unless the user set it.
    True when this call set it: the caller then takes it back with `remove_default` when its run ends."""
    if name in os.environ:
        return False
    os.environ[name] = value
    return True


def remove_default(name: str) -> None:
    """Take back what `export_default` set: a variable left behind outlives the run in this process (a
    notebook's next cell, the next test) and tells other libraries something that is no longer true
    (Transformers reads LOCAL_RANK as "this process is one rank of a distributed job")."""
    os.environ.pop(name, None)
