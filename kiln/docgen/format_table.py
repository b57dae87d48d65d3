"""The "which checkpoint format resumes where" table of docs/checkpoints.md, computed from the format registry
(kiln.strategies.checkpoint_io.FORMATS) and each strategy's `checkpoint_formats`: a strategy resumes a
format natively when one of its formats' CheckpointIO `resumes` it, and translated when the registry's
translation routes it there (kiln.strategies.format_translation.route, the rule resume itself follows).
The table sits between two markers in the hand-written page; `python -m kiln.docgen` rewrites only what
is between them."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

BEGIN = "<!-- generated: format table (python -m kiln.docgen) -->"
END = "<!-- end of generated format table -->"


def _io(fmt: str) -> Any:
    from kiln.registry import UnknownNameError
    from kiln.strategies.checkpoint_io import FORMATS

    try:
        return FORMATS.get(fmt)
    except UnknownNameError:
        return None


def format_rows() -> list[dict[str, Any]]:
    """One row per registered format: who writes it, who resumes it, and what it allows."""
    from kiln.docgen.strategy_matrix import strategies
    from kiln.strategies.checkpoint_io import FORMATS, CheckpointIO
    from kiln.strategies.format_translation import route

    listed = strategies()
    rows = []
    for fmt in sorted(FORMATS.names()):
        io = _io(fmt)
        # the strategies' formats: not a plug-in a caller (a test) registered, nor the engine's `peft-adapter`
        # (chosen by the model, not the strategy: docs/checkpoints.md's PEFT section)
        if io is None or not io.__module__.startswith("kiln.strategies."):
            continue
        routes = [
            (name, {route(i, fmt) for i in map(_io, cls.checkpoint_formats) if i is not None})
            for name, cls, _ in listed
        ]
        rows.append(
            {
                "format": fmt,
                "written": [name for name, cls, _ in listed if fmt in cls.checkpoint_formats],
                "resumed": [name for name, found in routes if "native" in found],
                "translated": [name for name, found in routes if "translated" in found and "native" not in found],
                "reshardable": bool(io.reshardable),
                "background": io.saves_in_background(),
                "convert": _function(io.consolidate) is not _function(CheckpointIO.consolidate),
            }
        )
    return rows


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) or "— (read only)"


def format_table_markdown() -> str:
    lines = [
        BEGIN,
        "",
        "| format (in `COMPLETE`) | written by | resumed by | resumed by, translated | on another process count "
        "| written in the background (`save.async`) | `kiln convert` |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in format_rows():
        lines.append(
            f"| `{row['format']}` | {_names(row['written'])} | {_names(row['resumed']) if row['resumed'] else 'none'} "
            f"| {_names(row['translated']) if row['translated'] else 'none'} "
            f"| {'yes' if row['reshardable'] else 'no: refused'} | {'yes' if row['background'] else 'no'} "
            f"| {'yes' if row['convert'] else 'no'} |"
        )
    return "\n".join([*lines, "", END])


def with_format_table(page: str) -> str:
    """`page` with the text between the markers replaced by the current table."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + format_table_markdown() + page[end:]


def _function(method: Callable[..., Any]) -> object:
    """The function behind a classmethod bound to its class (the same object for every subclass that inherits it);
    the cast: `consolidate` is a classmethod, so reading it gives a bound method (mypy types it a plain callable)."""
    return cast(types.MethodType, method).__func__
