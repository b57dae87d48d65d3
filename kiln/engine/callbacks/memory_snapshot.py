"""`memory_snapshot:` CUDA allocation history for PyTorch's memory viewer (https://pytorch.org/memory_viz).

With the section on, recording starts with training (`torch.cuda.memory._record_memory_history`, every
allocation with its Python and C++ stack, up to `max_entries` events). A snapshot is dumped after each
optimizer step named in `steps`, and with `on_oom` when the CUDA allocator runs out of memory (torch's
out-of-memory observer runs before the error is raised, while the allocations are still live). Files go
to `<output_dir>/memory_snapshots/rank<R>/step<N>.pickle` and `oom.pickle`. An out-of-memory error that
ends the run carries a note naming the snapshot and the largest allocation sites in it (the `on_exception`
event, before the error leaves the fit).

Only CUDA keeps an allocation history, so the section is refused for any other device.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from typing import TYPE_CHECKING, Any

from kiln.engine.callbacks.base import Callback
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.state import TrainerControl, TrainerState


def memory_snapshot_callback(config: Any, global_rank: int, device_type: str) -> MemorySnapshot | None:
    """The callback `memory_snapshot:` asks for, or None when the section is off."""
    section = config.memory_snapshot
    steps = sorted({int(s) for s in section.steps})
    if not steps and not section.on_oom:
        return None
    if device_type != "cuda":
        raise ConfigError(
            f"memory_snapshot records the CUDA allocator's history, and this run trains on {device_type}; "
            "remove the memory_snapshot section or train on a GPU."
        )
    if any(s < 1 for s in steps):
        raise ConfigError(
            f"memory_snapshot.steps holds {steps[0]}; name optimizer steps from 1 (global_step after the step)."
        )
    folder = os.path.join(
        section.output_dir or os.path.join(config.output_dir, "memory_snapshots"), f"rank{global_rank}"
    )
    return MemorySnapshot(folder, steps, bool(section.on_oom), int(section.max_entries))


def largest_sites(snapshot: dict[str, Any], top: int = 5) -> list[tuple[str, int]]:
    """The `top` source lines holding the most live bytes in `snapshot` (torch.cuda.memory._snapshot()):
    each allocated block charged to the innermost Python frame of its allocation stack."""
    sites: Counter[str] = Counter()
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if str(f.get("filename", "")).endswith(".py")]
            where = f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "<no Python frame>"
            sites[where] += int(block.get("size", 0))
    return sites.most_common(top)


class MemorySnapshot(Callback):
    reads_checkpoint_on_save = False

    def __init__(self, folder: str, steps: list[int], on_oom: bool, max_entries: int) -> None:
        self.folder, self.steps, self.on_oom, self.max_entries = folder, set(steps), on_oom, max_entries
        self.oom_path: str | None = None
        self.oom_sites: list[tuple[str, int]] = []

    def _dump(self, name: str) -> tuple[str, dict[str, Any]]:
        import torch

        snapshot = torch.cuda.memory._snapshot()
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, name)
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        return path, snapshot

    def _observe_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        self.oom_path, snapshot = self._dump("oom.pickle")
        self.oom_sites = largest_sites(snapshot)

    def on_train_begin(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        import torch

        torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        if self.on_oom:
            torch._C._cuda_attach_out_of_memory_observer(self._observe_oom)  # type: ignore[attr-defined]  # private torch API (what torch.cuda.memory._record_memory_history uses), absent from torch's stubs

    def on_step_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if state.global_step in self.steps:
            self._dump(f"step{state.global_step}.pickle")

    def on_train_end(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)

    def on_exception(self, config: DictConfig, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        import torch

        err = kw.get("exception")
        note = self.oom_note()
        if note is not None and isinstance(err, torch.OutOfMemoryError):
            err.add_note(note)  # printed under the error's message by the traceback

    def oom_note(self) -> str | None:
        """What an out-of-memory error that ends the run should add: the snapshot and where the memory was."""
        if self.oom_path is None:
            return None
        sites = "; ".join(f"{where} ({size / 2**20:.1f} MiB)" for where, size in self.oom_sites) or "none recorded"
        return (
            f"The CUDA memory at the failed allocation is in {self.oom_path} (open it at https://pytorch.org/memory_viz); "
            f"the largest allocation sites: {sites}."
        )
