"""Resume across checkpoint formats, through the format registry.

A run resumes a checkpoint natively when its CheckpointIO `resumes` the format named in the checkpoint's
COMPLETE marker. Otherwise, when both formats are `translatable`, the checkpoint's own format reads it as
a `PortableState` (full weights and optimizer state, in one process) and the run's IO loads that: a
single/DDP checkpoint resumes under FSDP or model_parallel and back, whichever process count saved it.
Any other pair is refused in one sentence that names the fix (the saved format's `translation_hint`:
DeepSpeed's names `kiln convert`). The engine only asks `resuming_io` which IO loads a checkpoint; no
format is named here."""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from kiln.strategies.checkpoint_io import FORMATS, CheckpointIO
from kiln.utils.errors import CheckpointError

log = logging.getLogger(__name__)

Route = Literal["native", "translated"]


def route(io: CheckpointIO | type[CheckpointIO], fmt: str) -> Route | None:
    """How a run whose IO is `io` resumes a checkpoint of format `fmt`: natively, translated, or not at all."""
    if fmt == io.format or fmt in io.also_resumes:
        return "native"
    source = FORMATS.get(fmt) if fmt in FORMATS else None
    if source is not None and source.translatable and io.translatable:
        return "translated"
    return None


class Translated(CheckpointIO):
    """Resumes a checkpoint of the `source` format into a run whose IO (`target`) writes another. The
    portable state is whole, so any process count may have saved it."""

    reshardable = True

    def __init__(self, source: type[CheckpointIO], target: CheckpointIO) -> None:
        self.source, self.target = source, target

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        log.info(
            "Resuming %s, a %r checkpoint, through its full state into this run's %r format.",
            directory,
            self.source.format,
            self.target.format,
        )
        state = self.source.portable(directory)
        self.target.load_portable(
            state, module=module, optimizer=optimizer if load_optimizer else None, source=directory
        )


def resuming_io(io: CheckpointIO, fmt: str, path: str) -> CheckpointIO:
    """The IO that resumes the checkpoint `path`, of format `fmt`, in a run whose IO is `io`; one sentence
    naming the fix when none can."""
    how = route(io, fmt)
    if how == "native":
        return io
    if how == "translated":
        return Translated(FORMATS.get(fmt), io)
    source = FORMATS.get(fmt) if fmt in FORMATS else None
    hint = source.translation_hint if source is not None and not source.translatable else CheckpointIO.translation_hint
    raise CheckpointError(
        f"{path} was saved by a strategy with the {fmt!r} checkpoint format, but this run uses {io.format!r}; {hint}."
    )
