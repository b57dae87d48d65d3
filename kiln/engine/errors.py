"""Error types with one-sentence messages, and the only way kiln reads pickled files."""

from __future__ import annotations

import pickle
from typing import Any


class KilnError(RuntimeError):
    """Base for errors that explain a user-fixable problem."""


class CheckpointError(KilnError):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or does not fit this run."""


def safe_torch_load(path: str) -> Any:
    """torch.load with weights_only=True: tensors and plain containers only, never code.

    A file that holds arbitrary Python objects (a malicious or foreign pickle) is refused and nothing
    from it runs."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"Refusing to load {path}: it contains Python objects other than tensors and plain containers "
            f"({str(err).splitlines()[0][:160]}). kiln never executes code from a checkpoint; re-create it with kiln."
        ) from None
    except (EOFError, RuntimeError) as err:
        raise CheckpointError(f"{path} is corrupt or truncated ({str(err).splitlines()[0][:160]}).") from None
