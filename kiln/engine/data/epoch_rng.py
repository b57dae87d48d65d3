"""The random state a train loader's epoch order is drawn from, saved so that a resume is exact.

A DataLoader the user passes is used as given: its generator is never re-seeded, so its stream
continues from one epoch into the next exactly as the loader would run on its own (HF). Its epoch
order is drawn when the epoch's iterator starts, from the loader's `generator`, or from the global torch
RNG when it has none. So at every epoch start both states are captured (and saved in each checkpoint);
a run resumed inside that epoch puts them back before rebuilding the iterator and skipping to the saved
batch, and a run resumed at an epoch boundary continues the generator from its saved current state.
kiln's own loaders, whose order depends only on (seed, epoch), go through the same steps harmlessly."""

from __future__ import annotations

from typing import Any

import torch


def _generator(loader: Any) -> torch.Generator | None:
    generator = getattr(loader, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


class EpochRandomState:
    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.start: dict[str, Any] | None = None  # the states at the current epoch's start
        self.resumed: dict[str, Any] | None = None  # what a checkpoint held, until the first epoch uses it

    def begin_epoch(self, skip: int) -> None:
        """Before the epoch's iterator is built: replay the saved epoch start (resumed mid-epoch), continue
        the generator where the checkpoint left it (resumed at a boundary), then record this epoch's start."""
        saved, self.resumed = self.resumed, None
        generator = _generator(self.loader)
        if saved is not None and skip and saved.get("start") is not None:
            start = saved["start"]
            if generator is not None and start.get("generator") is not None:
                generator.set_state(start["generator"])
            torch.set_rng_state(start["torch"])  # the caller restores the mid-epoch RNG after skipping
        elif saved is not None and generator is not None and saved.get("generator_now") is not None:
            generator.set_state(saved["generator_now"])
        self.start = {
            "generator": generator.get_state() if generator is not None else None,
            "torch": torch.get_rng_state(),
        }

    def state_dict(self) -> dict[str, Any]:
        generator = _generator(self.loader)
        return {"start": self.start, "generator_now": generator.get_state() if generator is not None else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.resumed = state
