"""TF32 matmul/cuDNN mode on Ampere+ GPUs: the process-wide flags behind `precision.tf32`.

Every plugin applies `precision.tf32` in `Precision.setup` through `set_tf32` and puts back the exact
previous flags in `teardown` through `restore_tf32`, so a run never leaks its TF32 choice into the
rest of the process (a notebook, a test suite, a second `fit`).

torch has two APIs for these flags, and mixing them makes torch's getters raise ("you have used mix
of the legacy and new APIs"). We write with the API the process already uses: the legacy
`allow_tf32` flags (which keep both APIs readable) unless the user has switched to the
`fp32_precision` strings, which make the legacy getters unreadable."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kiln.utils.errors import PrecisionError

#: a snapshot of every TF32-related flag: dotted path under torch.backends -> value
TF32State = dict[str, Any]

_UNREADABLE = "<unreadable>"
_LEGACY = ("cuda.matmul.allow_tf32", "cudnn.allow_tf32")
_MATMUL_PRECISION = "float32_matmul_precision"
# parents before children: setting a parent's fp32_precision may overwrite its children
_NEW = (
    "fp32_precision",
    "cuda.matmul.fp32_precision",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)
# what `tf32: true/false` writes with the fp32_precision API (the CUDA ones; never the CPU's mkldnn)
_NEW_TF32 = ("cuda.matmul.fp32_precision", "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision")


_MISSING = object()


def _get(path: str) -> Any:
    """The flag's value, `_UNREADABLE` if torch refuses to read it (APIs mixed), `_MISSING` if this
    torch does not have it."""
    *parents, attr = path.split(".")
    try:
        owner = functools.reduce(getattr, parents, torch.backends)
        return getattr(owner, attr)
    except AttributeError:
        return _MISSING
    except RuntimeError:  # "you have used mix of the legacy and new APIs"
        return _UNREADABLE


def _set(path: str, value: Any) -> None:
    *parents, attr = path.split(".")
    setattr(functools.reduce(getattr, parents, torch.backends), attr, value)


def _matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return _UNREADABLE


def tf32_state() -> TF32State:
    """Every TF32-related flag of this process (unreadable ones recorded as such)."""
    state: TF32State = {}
    for path in _LEGACY + _NEW:
        value = _get(path)
        if value is not _MISSING:
            state[path] = value
    state[_MATMUL_PRECISION] = _matmul_precision()
    return state


def _legacy_readable(state: TF32State) -> bool:
    return all(state.get(path, _UNREADABLE) != _UNREADABLE for path in _LEGACY)


def set_tf32(enabled: bool) -> TF32State:
    """Allow (True) or forbid (False) TF32 for CUDA matmuls and cuDNN; returns the previous flags
    for `restore_tf32`."""
    saved = tf32_state()
    if _legacy_readable(saved):
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    else:
        for path in _NEW_TF32:
            if _get(path) is not _MISSING:
                _set(path, "tf32" if enabled else "ieee")
    return saved


def restore_tf32(saved: TF32State) -> None:
    """Put back exactly the flags `saved` records: legacy flags first (they also rewrite the new
    strings), then any new-API string that now differs."""
    if _legacy_readable(saved):
        for path in _LEGACY:
            if path in saved:
                _set(path, saved[path])
        matmul = saved[_MATMUL_PRECISION]
        if matmul != _UNREADABLE and _matmul_precision() != matmul:
            torch.set_float32_matmul_precision(matmul)
    for path in _NEW:
        if saved.get(path, _UNREADABLE) != _UNREADABLE and _get(path) != saved[path]:
            _set(path, saved[path])


def check_tf32_device(device: torch.device) -> None:
    """TF32 is a mode of NVIDIA Ampere+ tensor cores; anywhere else `tf32: true` would do nothing."""
    if device.type != "cuda":
        raise PrecisionError(
            f"precision.tf32 is true, but TF32 only applies to NVIDIA Ampere or newer GPUs and this run "
            f"uses device {str(device)!r}; remove tf32 (or set it to false) on this machine."
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise PrecisionError(
            f"precision.tf32 is true, but TF32 needs an Ampere or newer GPU (compute capability >= 8.0) and "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}; remove tf32 (or set it to false)."
        )
