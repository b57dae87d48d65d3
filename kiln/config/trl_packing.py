"""TRL's `SFTConfig` names for packing, mapped onto `data.packing`: `packing`, `packing_strategy`,
`padding_free`, and `max_length` / `max_seq_length` (TRL's older name) where they mean the packed row's length.

Two of them only mean something together, so `pair` reads them before the names are rewritten one by one:
TRL's `packing_strategy` (default "bfd" in every SFTConfig, packing or not) chooses the strategy only when
`packing` is true; and TRL's `max_length` is the row length only when packing, while without packing TRL
truncates examples with it as it tokenizes them, which kiln (it never tokenizes) cannot do, so there it is
dropped with a warning instead of being read as a packing length."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kiln.utils.truthy import truthy

STRATEGIES = ("bfd", "bfd_split", "wrapped")
LENGTH_NAMES = ("max_length", "max_seq_length")
PAIRED = frozenset(("packing", "packing_strategy", *LENGTH_NAMES))

log = logging.getLogger(__name__)


def pair(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """`raw` with TRL's packing names folded so that each can be rewritten alone: `packing: true` with
    `packing_strategy: S` becomes `packing: S`; without packing, the strategy is dropped (as TRL ignores
    it) and so are the lengths (see the module docstring)."""
    if not PAIRED & raw.keys():
        return raw
    out = dict(raw)
    strategy = out.pop("packing_strategy", None)
    if truthy(out.get("packing")):
        if strategy is not None:
            out["packing"] = strategy
        return out
    for name in LENGTH_NAMES:
        if out.pop(name, None) is not None:
            log.warning(
                "%s=%r has no effect without packing: TRL truncates examples to it while tokenizing, and kiln "
                "does not tokenize; truncate the examples when you tokenize them.",
                name,
                raw[name],
            )
    return out


def packing(value: Any) -> dict[str, Any]:
    """TRL's `packing: true` packs with TRL's default strategy, bfd (or with the strategy `pair` put there)."""
    if isinstance(value, str) and value.strip().lower() in STRATEGIES:
        return {"data.packing.strategy": value.strip().lower()}
    if isinstance(value, str) and not truthy(value) and value.strip().lower() not in ("0", "false", "no", "off", ""):
        raise ValueError(
            f"{value!r} is not a packing strategy (packing / packing_strategy); choose one of {', '.join(STRATEGIES)}."
        )
    return {"data.packing.strategy": "bfd"} if truthy(value) else {}


def max_length(value: Any) -> dict[str, Any]:
    """TRL's row length when packing (`pair` drops it otherwise); TRL refuses packing without one."""
    if value is None:
        raise ValueError("packing needs max_length (the packed row's length); give a number of tokens.")
    return {"data.packing.max_length": value}


def padding_free(value: Any) -> dict[str, Any]:
    """TRL's `padding_free`; None leaves kiln's choice by attention implementation."""
    return {} if value is None else {"data.packing.padding_free": truthy(value)}


def eval_packing(value: Any) -> dict[str, Any]:
    """TRL's `eval_packing`: kiln packs training batches only."""
    if truthy(value):
        raise ValueError(
            f"eval_packing={value!r} is not supported by kiln: kiln packs training data only "
            "(data.packing); evaluation batches are padded. Drop eval_packing."
        )
    return {}


REWRITES = {
    "eval_packing": eval_packing,
    "packing": packing,
    "packing_strategy": lambda value: {},  # read by `pair` with `packing`
    "padding_free": padding_free,
    **{name: max_length for name in LENGTH_NAMES},
}
