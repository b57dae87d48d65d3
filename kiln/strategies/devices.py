"""Choosing the device a one-device strategy runs on, through the accelerator registry."""

from __future__ import annotations

import torch

from kiln.utils.errors import ConfigError

_KINDS = {"cuda": "CUDA", "mps": "MPS (Apple silicon GPUs)", "xla": "XLA (torch_xla)"}


def resolve_device(requested: str | None, default_kinds: tuple[str, ...] = ("cuda",)) -> torch.device:
    """`requested` (strategy.device: cpu, cuda, cuda:1, mps, ...) checked against this machine, or
    the first available of `default_kinds`, else the CPU."""
    from kiln.accelerators import ACCELERATORS

    if requested:
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise ConfigError(
                f"strategy.device {requested!r} is not a device; use cpu, cuda, cuda:<index> or mps."
            ) from None
        if device.type not in ACCELERATORS:
            raise ConfigError(
                f"strategy.device={requested!r}: kiln has no accelerator for {device.type!r}; "
                f"use one of {', '.join(ACCELERATORS.names())}."
            )
        if not ACCELERATORS.get(device.type).is_available():
            raise ConfigError(
                f"strategy.device is {requested!r} but {_KINDS.get(device.type, device.type)} is not available "
                "on this machine; use strategy.device=cpu (or leave it unset to pick the best device)."
            )
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"strategy.device is {requested!r} but this machine has {torch.cuda.device_count()} CUDA "
                "device(s); pick an index below that."
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    for kind in default_kinds:
        accelerator = ACCELERATORS.get(kind)
        if accelerator.is_available():
            return accelerator().device()
    return torch.device("cpu")
