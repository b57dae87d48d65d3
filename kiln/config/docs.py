"""Render the config tree's help texts (for `kiln fit --help` and docs/config.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.config import aliases
from kiln.config.schema import TrainingConfig


def _rows(obj: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            doc = (type(value).__doc__ or "").strip().splitlines()[0]
            rows.append((f"{prefix}{f.name}", "group", "", doc))
            rows += _rows(value, f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", str(f.type).replace("typing.", ""), repr(value), f.metadata.get("help", "")))
    return rows


def config_help() -> str:
    """Plain-text listing of every key with its default and help (starts on its own line)."""
    lines = ["top level:"]
    for key, kind, default, help_ in _rows(TrainingConfig()):
        if kind == "group":
            lines.append(f"\n{key}:  {help_}")
        else:
            lines.append(f"  {key} = {default}\n      {help_}")
    hf = ", ".join(sorted(set(aliases.PATHS) | set(aliases.REWRITES) - set(aliases.UNSUPPORTED)))
    lines.append(f"\nHugging Face TrainingArguments names accepted as aliases:\n  {hf}")
    return "\n".join(lines)


def config_markdown() -> str:
    """docs/config.md: one table per group."""
    out = ["# Config reference", "", "Generated from `kiln/config/schema.py` (`kiln config-docs`). "
           "Every key can be set in YAML, as `key=value` on the command line, or in the Python API; "
           "Hugging Face `TrainingArguments` names work too (table at the end).", "", "## Top level", "",
           "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, help_ in _rows(TrainingConfig()):
        if kind == "group":
            out += ["", f"## `{key}`", "", help_, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        else:
            out.append(f"| `{key}` | `{kind}` | `{default}` | {help_} |")
    out += ["", "## Hugging Face names", "", "| HF name | kiln key |", "|---|---|"]
    out += [f"| `{k}` | `{v}` |" for k, v in sorted(aliases.PATHS.items())]
    out += [f"| `{k}` | (switches a plugin; see kiln/config/aliases.py) |" for k in sorted(aliases.REWRITES)
            if k not in aliases.UNSUPPORTED]
    out += ["", "Accepted and dropped: " + ", ".join(f"`{k}`" for k in sorted(aliases.IGNORED)) + ".", "",
            "Accepted only while off (their HF default); switched on they are refused with the alternative:", "",
            "| HF name | instead |", "|---|---|"]
    out += [f"| `{k}` | {reason} |" for k, reason in sorted(aliases.UNSUPPORTED.items())]
    return "\n".join(out) + "\n"
