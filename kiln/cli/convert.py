"""`kiln convert`: a checkpoint's full weights (FSDP or ZeRO shards merged) as OUT/model.safetensors."""

from __future__ import annotations

import sys


def convert(rest: list[str]) -> int:
    """`kiln convert CHECKPOINT OUT [--signing-key-env NAME]`: a checkpoint's full weights as one safetensors file."""
    env = None
    if len(rest) == 4 and rest[2] == "--signing-key-env":
        rest, env = rest[:2], rest[3]
    if len(rest) != 2 or rest[0].startswith("-"):
        print("usage: kiln convert CHECKPOINT OUT [--signing-key-env NAME]", file=sys.stderr)
        return 2
    from kiln.engine.checkpoint.convert import convert_checkpoint
    from kiln.engine.checkpoint.signing import signing_key
    from kiln.utils.errors import KilnError

    try:
        print(convert_checkpoint(rest[0], rest[1], signing_key(env)))
    except KilnError as err:
        print(f"kiln convert: {err}", file=sys.stderr)
        return 1
    return 0
