"""Reads a W&B offline run folder (`run-<id>.wandb`): the records wandb-core wrote, as protobufs.

The file is W&B's LevelDB-style log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each `crc32c (4) | length (2, LE) | type (1: full, 2: first, 3: middle, 4: last)`
followed by the bytes of one `wandb_internal_pb2.Record`. (wandb's Python reader for this format was
removed when the writer moved to wandb-core.)"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from typing import Any

BLOCK = 32768
HEADER = 7


def records(path: str) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path} is not a W&B log"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):  # still being written
            break
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_runs(output_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*")))


def _wait_for_exit(path: str, timeout: float) -> list[Any]:
    """`run.finish(exit_code=1)` returns before wandb-core has written the run: wait for its exit record."""
    deadline = time.monotonic() + timeout
    while True:
        found = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def read_run(run_dir: str, timeout: float = 30.0) -> dict[str, Any]:
    """{"id", "name", "project", "group", "config": {key: value}, "history": [row, ...], "exit_code"}"""
    [path] = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run: dict[str, Any] = {"config": {}, "history": [], "exit_code": None}
    for record in _wait_for_exit(path, timeout):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(id=r.run_id, name=r.display_name, project=r.project, group=r.run_group)
            run["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "config":
            run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            run["history"].append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run
