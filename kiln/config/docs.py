"""Render the config tree's help texts (for `kiln fit --help` and docs/config.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.config.hf import aliases
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
            rows.append(
                (f"{prefix}{f.name}", str(f.type).replace("typing.", ""), repr(value), f.metadata.get("help", ""))
            )
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


_TRUST = [
    "## A config is code; what kiln saves of it",
    "",
    "Treat a config file like a script: `task.model` and `task.data` name "
    "Python callables (`package.module:callable`) that kiln imports and calls, so running a config runs code from the modules it names. Only run "
    "configs you would run as code.",
    "",
    "kiln resolves interpolations once, when it loads the config: training reads the values, and "
    "`${oc.env:VAR}` reads the environment variable then (an unset one is refused by name unless a default is given, "
    "`${oc.env:VAR,default}`). What kiln writes and logs of the config — every checkpoint's `config.yaml`, "
    "`kiln_config.yaml` next to the exported model, and the hyperparameters sent to TensorBoard, MLflow and W&B — is "
    "the resolved config, except that a value taken from the environment reads `${oc.env:VAR}` again wherever it "
    "appears in a string (values under 6 characters only where they are the whole string). Pass tokens and passwords "
    "that way, never as literal values: a literal is saved as written. A saved config resolves to the same run where "
    "the same variables are set (`kiln.config.redact.config_for_saving` is the one function that makes this copy).",
]


def config_markdown() -> str:
    """docs/config.md: one table per group."""
    out = [
        "# Config reference",
        "",
        "Generated from `kiln/config/schema/` (`kiln config-docs`). "
        "Every key can be set in YAML, as `key=value` on the command line, or in the Python API; "
        "Hugging Face `TrainingArguments` names work too (table at the end).",
        "",
        *_TRUST,
        "",
        "## Top level",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key, kind, default, help_ in _rows(TrainingConfig()):
        if kind == "group":
            out += ["", f"## `{key}`", "", help_, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        else:
            out.append(f"| `{key}` | `{kind}` | `{default}` | {help_} |")
    out += ["", "## Hugging Face names", "", "| HF name | kiln key |", "|---|---|"]
    out += [f"| `{k}` | `{v}` |" for k, v in sorted(aliases.PATHS.items())]
    out += [
        f"| `{k}` | (switches a plugin; see kiln/config/hf/aliases.py) |"
        for k in sorted(aliases.REWRITES)
        if k not in aliases.UNSUPPORTED and k not in aliases.NO_EFFECT
    ]
    out += ["", "Accepted and dropped: " + ", ".join(f"`{k}`" for k in sorted(aliases.IGNORED)) + ".", ""]
    out += ["Accepted with any value; switched on, one log line says it has no effect:", ""]
    out += [f"- `{k}`: {reason}." for k, reason in sorted(aliases.NO_EFFECT.items())]
    out += [
        "",
        "Accepted only while off (their HF default); switched on they are refused with the alternative:",
        "",
        "| HF name | instead |",
        "|---|---|",
    ]
    out += [f"| `{k}` | {reason} |" for k, reason in sorted(aliases.UNSUPPORTED.items())]
    return "\n".join(out) + "\n"
