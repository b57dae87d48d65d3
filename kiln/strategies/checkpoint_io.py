"""The CheckpointIO contract and the registry of checkpoint formats. Strategies whose ranks each hold the
full model (single, DDP) use `FullStateCheckpointIO` (kiln.strategies.full_checkpoint_io); sharding strategies
(the mesh strategy, DeepSpeed, XLA) subclass `CheckpointIO` in their own file with their own format and register
it there.

`FORMATS` maps the format a checkpoint's COMPLETE marker names to its CheckpointIO class, whose
`consolidate(path)` reads the folder's full weights in one process (what `kiln convert` writes). The
built-in formats are registered lazily by module, like the strategies, so `kiln convert` imports
only the one module the checkpoint needs; a plug-in registers its own with `@register_format`."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from kiln.registry import Registry
from kiln.strategies.portable_state import PortableState
from kiln.utils.host_copy import HostStaging

#: what `CheckpointIO.stage` returns: writes the staged files into a checkpoint folder, later, on a
#: background thread (no collective, nothing read from the live model or optimizer)
StagedWrite = Callable[[str], None]


class CheckpointIO:
    """Writes and reads a strategy's model and optimizer files inside a checkpoint folder.

    The engine owns everything else in the folder (trainer state, RNG, scheduler, the COMPLETE
    marker written after every rank returned from `save`) and calls these on every rank:

    - `save(directory, model=, module=, optimizer=, save_optimizer=, safetensors=, writer=)`:
      `model` is the module as the strategy set it up (wrapped), `module` the user's module inside it,
      whose key names files use; `writer` says whether this rank writes the files of a format that
      is not `sharded` (rank 0, or each node's local rank 0 with save_on_each_node).
    - `load(directory, model=, module=, optimizer=, load_optimizer=)`: restore for resuming.
    - `load_weights_only(directory, model=, module=)`: weights alone (the CLI's evaluate/predict,
      load_best_model_at_end); any format this IO reads, also a plain exported model folder.

    `format` is recorded in the marker (and names the class in `FORMATS`); `also_resumes` names older
    formats whose checkpoints this IO resumes too (the same files under an earlier name); `translatable`
    says a folder of this format reads as a `PortableState` (`portable(path)`: full weights and optimizer
    state in one process) and that this IO loads one of any other translatable format (`load_portable`):
    such formats resume one another (kiln.strategies.format_translation), and `translation_hint` is the
    fix a refusal names when a run cannot take a checkpoint of this format in; `reshardable`
    says whether a checkpoint saved by N processes loads on M (the engine refuses a world-size change
    otherwise); `sharded` says every rank writes its own files. `consolidate(path)` gives a folder's full weights
    in one process without a process group (any process count may have saved it), vetting every
    pickle it reads first: converting a checkpoint never runs code from it.

    Optional, for `save.async_save`: `stage(directory, ...)` (the folder `save` would write into, the
    arguments of `save`, and the run's `HostStaging`, whose buffers are reused from save to save)
    copies at the step boundary what `save` would write into host memory and returns a `StagedWrite`
    that writes exactly those bytes into `directory` later, on a background thread, while training
    goes on. The engine calls `stage` on every rank and runs the returned write on every rank's
    background thread; the writer's write must return only once the files of every rank are durable
    (a format that is not `sharded` writes them all on the writer; a `sharded` one waits for its own
    collective, e.g. DCP's `async_save` future), since the writer then writes COMPLETE. The default
    returns None: the format saves synchronously (the engine says so once)."""

    format: ClassVar[str] = "full"
    also_resumes: ClassVar[tuple[str, ...]] = ()
    translatable: ClassVar[bool] = False
    translation_hint: ClassVar[str] = "resume with the strategy that saved it"
    reshardable: ClassVar[bool] = True
    sharded: ClassVar[bool] = False

    def resumes(self, fmt: str) -> bool:
        """Whether a checkpoint whose marker names format `fmt` can be resumed through this IO."""
        return fmt == self.format or fmt in self.also_resumes

    def save(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
    ) -> None:
        raise NotImplementedError

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        raise NotImplementedError

    def stage(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
        staging: HostStaging,
    ) -> StagedWrite | None:
        """The files `save` would write into `directory`, copied to host memory now and written by the returned function
        later; None when this format cannot save in the background (see the class docstring)."""
        return None

    @classmethod
    def saves_in_background(cls) -> bool:
        """Whether `stage` can hand back a staged write (`save.async`), rather than None."""
        return cls.stage is not CheckpointIO.stage

    def load_weights_only(self, directory: str, *, model: nn.Module, module: nn.Module) -> None:
        self.load(directory, model=model, module=module, optimizer=None, load_optimizer=False)

    @classmethod
    def portable(cls, directory: str) -> PortableState:
        """A `translatable` format's folder as full weights and optimizer state, read in one process."""
        raise NotImplementedError(f"checkpoint format {cls.format!r} cannot be translated")

    def load_portable(
        self, state: PortableState, *, module: nn.Module, optimizer: torch.optim.Optimizer | None, source: str
    ) -> None:
        """Resume from another format's `state` (read from the checkpoint `source`): a `translatable` IO's."""
        raise NotImplementedError(f"checkpoint format {self.format!r} cannot be translated")

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        """The full weights of a checkpoint folder of this format, with the user's module's key names."""
        raise NotImplementedError(f"checkpoint format {cls.format!r} does not say how to consolidate its files")


#: checkpoint format (the COMPLETE marker's "format") -> its CheckpointIO class
FORMATS: Registry[type[CheckpointIO]] = Registry("checkpoint format", "format")

for _formats, _module in (
    (("full",), "kiln.strategies.full_checkpoint_io"),
    (("fsdp-full", "fsdp-sharded", "model-parallel-dcp"), "kiln.strategies.mesh.checkpoint_io"),
    (("xla-full",), "kiln.strategies.xla.checkpoint_io"),
    (("xla-spmd-sharded", "xla-fsdp-classic"), "kiln.strategies.xla.fsdp_checkpoint_io"),
    (("deepspeed",), "kiln.strategies.deepspeed.checkpoint_io"),
):
    for _format in _formats:
        FORMATS.add_lazy(_format, _module)


def register_format(cls: type[CheckpointIO]) -> type[CheckpointIO]:
    """Class decorator: register a CheckpointIO under its own `format` (a plug-in's file does this;
    the built-in formats also have an `add_lazy` line above)."""
    FORMATS.add(cls.format, cls)
    return cls
