"""The one number a DataLoader iterator without a generator takes from torch's global RNG."""

from __future__ import annotations

import torch


def global_draw() -> None:
    """What torch's DataLoader iterator draws for its base seed when the loader has no generator: HF's
    loaders have none, so every training epoch and every evaluation moves the global RNG by one number
    before the first batch, and dropout then draws its masks from there. Drawing the same keeps kiln's
    dropout masks, and so its losses, equal to HF's."""
    torch.empty((), dtype=torch.int64).random_()
