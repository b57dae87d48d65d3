"""The CLI's `task.model` / `task.data`: import a callable named by path, and check its keyword
arguments before it is called, so that a typo or a wrong working directory is one sentence naming
the fix instead of a traceback after the data was built."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any


class TaskError(Exception):
    """A task import path or its arguments are wrong; the message says how to fix it."""


def import_callable(path: str, key: str) -> Callable[..., Any]:
    """`package.module:callable` (or `package.module.callable`) -> the callable."""
    if os.getcwd() not in sys.path:  # like `python -m`: modules next to where kiln is run are importable
        sys.path.insert(0, os.getcwd())
    module_name, _, attr = path.partition(":")
    if not attr:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise TaskError(f"{key}={path!r} is not an import path; write it as 'package.module:callable'.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            from kiln.launch.environment.variables import python_path

            pythonpath = python_path() or "unset"
            raise TaskError(
                f"cannot import {key}={path!r}: no module {missing!r} on the import path (working directory "
                f"{os.getcwd()}, PYTHONPATH {pythonpath}); run kiln from the folder that holds "
                f"'{missing.split('.')[0]}', or add that folder to PYTHONPATH."
            ) from None
        raise TaskError(
            f"cannot import {key}={path!r}: importing {module_name} needs {missing!r}, which is not installed ({err})."
        ) from None
    except ImportError as err:
        raise TaskError(f"cannot import {key}={path!r}: {err}.") from None
    if not hasattr(module, attr):
        public = [name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))]
        close = difflib.get_close_matches(attr, public, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TaskError(f"cannot import {key}={path!r}: module {module_name!r} has no {attr!r}.{hint}")
    return getattr(module, attr)


def check_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any], key: str, path: str) -> None:
    """Raise TaskError naming `path`'s parameters if `kwargs` holds a name `fn` does not take."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [
        name
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    unknown = [name for name in kwargs if name not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TaskError(
            f"{key} has {', '.join(map(repr, unknown))}, which {path} does not take; its parameters are "
            f"{', '.join(names) or '(none)'}.{hint}"
        )
