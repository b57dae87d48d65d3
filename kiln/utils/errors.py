"""Error types with one-sentence messages, and the only way kiln reads pickled files."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any


class KilnError(RuntimeError):
    """Base for errors that explain a user-fixable problem."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during fit(): still a KeyboardInterrupt, with the sentence to print instead of a
    traceback ("interrupted at step N; last checkpoint: PATH")."""


class RankFailed(KilnError):
    """`fit()` failed on another rank, which aborted the process group so that this rank stops now
    rather than at the collective timeout; the message names that rank and its error."""


class CheckpointError(KilnError):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or does not fit this run."""


class ConfigError(ValueError):
    """A config key, value or combination is invalid; the message names the key and the fix."""


class PrecisionError(ValueError):
    """A precision setting cannot work on this machine or with these options; the message says why
    and what to use instead. Raised before training starts."""


class CapabilityError(KilnError):
    """A strategy, precision and device were combined in a way that cannot work; raised before any
    process group starts, with the sentence that says why and what to use instead."""


def _reason(err: BaseException) -> str:
    """The informative line of a torch.load error (torch puts a long generic preamble first, which
    also suggests `weights_only=False`: advice kiln must never pass on)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if any(key in line for key in ("GLOBAL", "Unsupported", "WeightsUnpickler", "miniz", "legacy")):
            # the global's name, without torch's advice to allow-list it
            return line.replace("WeightsUnpickler error: ", "").split(" was not an allowed global")[0][:200]
    return (lines[0] if lines else type(err).__name__)[:200]


def safe_torch_load(path: str, allow: Sequence[Any] = (), what: str = "", mmap: bool = False) -> Any:
    """torch.load with weights_only=True: tensors and plain containers only, never code.

    A file that holds arbitrary Python objects (a malicious or foreign pickle) is refused and nothing
    from it runs; a truncated or garbled file raises CheckpointError naming the file. `allow` admits a
    few more classes that are known to be plain data (DeepSpeed's loss scaler, ZeRO stage enum...),
    `what` names them in the refusal; `mmap` maps the tensors instead of reading them (for a pre-pass)."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        reason = _reason(err)
        if "Weights only load failed" in str(err) or "GLOBAL" in reason or "Unsupported" in reason:
            raise CheckpointError(
                f"Refusing to load {path}: it holds Python objects other than tensors{', ' + what if what else ''} "
                f"and plain containers ({reason}); kiln never executes code from a checkpoint, so re-create it with kiln."
            ) from None
        raise CheckpointError(f"{path} is corrupt or truncated ({reason}).") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing.") from None
    except Exception as err:  # torch raises RuntimeError, EOFError, ValueError... for damaged files
        raise CheckpointError(f"{path} is corrupt, truncated or not a torch file ({_reason(err)}).") from None
