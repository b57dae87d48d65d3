"""Skip a test module whose optional package is missing, without importing the package at collection.

`pytest.importorskip` at a module's top imports the package while the file is collected, and every
xdist worker collects every file: scikit-learn, W&B, MLflow, Comet, Neptune and PEFT cost seconds
each, paid by both workers before their first test. `requires` only looks the package up; the tests
import it where they use it."""

from __future__ import annotations

import importlib.util

import pytest


def requires(package: str, reason: str = "") -> pytest.MarkDecorator:
    """A skip mark for when `package` (a top-level name) is not installed; `reason` says how to get it."""
    why = f"could not import {package!r}" + (f": {reason}" if reason else "")
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=why)
