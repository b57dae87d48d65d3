"""One multi-process job running named cases, for the strategy tests whose workers only run cases and hand
back what rank 0 saw: `run_cases` on every rank (in the worker), `start` in the test (the parent)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def run_cases(
    run_case: Callable[[str, str, int], tuple[dict[str, Any], dict[str, torch.Tensor]]], out: str, names: list[str]
) -> None:
    """In a worker, on every rank: `run_case(entry, root, world)` for each entry (a case name, or
    `NAME=ARG` for a worker whose cases take an argument, filed under NAME); rank 0 writes
    OUT/results.json and OUT/tensors.safetensors (`<case>/<weight>`), then the group is left."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    world = int(os.environ.get("WORLD_SIZE", "1"))
    results, tensors = {}, {}
    for entry in names:
        name = entry.partition("=")[0]
        print("CASE", name, file=sys.stderr, flush=True)
        results[name], weights = run_case(entry, os.path.join(out, "runs"), world)
        tensors.update({f"{name}/{k}": v.contiguous() for k, v in weights.items()})
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, "tensors.safetensors"))
        with open(os.path.join(out, "results.json"), "w") as fh:
            json.dump(results, fh)
    if dist.is_initialized():  # leave the group before interpreter shutdown
        dist.barrier()
        dist.destroy_process_group()


def start(
    worker: Path, out: Path, names: list[str], timeout: float = 1200, nproc: int = 2
) -> tuple[dict[str, Any], dict[str, dict]]:
    """In the test: run `worker` on `nproc` processes over `names`; (results, {case: {weight: tensor}})."""
    from safetensors.torch import load_file

    from tests.world import run_world

    run_world(worker, out, *names, nproc=nproc, timeout=timeout)
    by_case: dict[str, dict] = {}
    for key, value in load_file(str(out / "tensors.safetensors")).items():
        case, name = key.split("/", 1)
        by_case.setdefault(case, {})[name] = value
    return json.loads((out / "results.json").read_text()), by_case
