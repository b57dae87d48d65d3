"""The CheckpointIO contract, the registry of checkpoint formats, and the CheckpointIO of strategies
whose ranks each hold the full model (single, DDP). Sharding strategies (the mesh strategy, DeepSpeed, XLA)
subclass `CheckpointIO` in their own file with their own format and register it there.

`FORMATS` maps the format a checkpoint's COMPLETE marker names to its CheckpointIO class, whose
`consolidate(path)` reads the folder's full weights in one process (what `kiln convert` writes). The
built-in formats are registered lazily by module, like the strategies, so `kiln convert` imports
only the one module the checkpoint needs; a plug-in registers its own with `@register_format`.

Weights go to `model.safetensors` (tied weights stored once, aliases recorded in the metadata) or
`pytorch_model.bin`; the optimizer to `optimizer.pt`. Loading never unpickles arbitrary objects."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.registry import Registry
from kiln.strategies.portable_state import PortableState, keyed_by_index, optimizer_names
from kiln.strategies.weights_files import INDEX, load_sharded, parse_size, save_sharded
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.host_copy import HostStaging
from kiln.utils.param_groups import regroup_optimizer_state

WEIGHTS_SAFE = "model.safetensors"
WEIGHTS_BIN = "pytorch_model.bin"
OPTIMIZER = "optimizer.pt"
#: what `CheckpointIO.stage` returns: writes the staged files into a checkpoint folder, later, on a
#: background thread (no collective, nothing read from the live model or optimizer)
StagedWrite = Callable[[str], None]


def save_weights(
    state: dict[str, torch.Tensor], directory: str, safetensors: bool = True, max_shard_size: int | str | None = None
) -> str:
    """Write a full state dict; returns the file name written (the index when sharded: with
    `max_shard_size`, weights above it are split into HF-layout shards)."""
    if not safetensors:
        torch.save(state, os.path.join(directory, WEIGHTS_BIN))
        return WEIGHTS_BIN
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:  # tied weights: store once, remember the alias
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.to("cpu").contiguous()
    meta = {"format": "pt", "kiln_aliases": json.dumps(aliases)}
    if max_shard_size is not None and sum(t.numel() * t.element_size() for t in tensors.values()) > parse_size(
        max_shard_size
    ):
        save_sharded(tensors, directory, max_shard_size, metadata={"kiln_aliases": meta["kiln_aliases"]})
        return INDEX
    save_file(tensors, os.path.join(directory, WEIGHTS_SAFE), metadata=meta)
    return WEIGHTS_SAFE


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """Read the weights a checkpoint or exported model folder holds (safetensors preferred)."""
    safe = os.path.join(directory, WEIGHTS_SAFE)
    if os.path.exists(safe):
        from safetensors import safe_open

        try:
            with safe_open(safe, framework="pt") as fh:
                meta = fh.metadata() or {}
                state = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 - safe_open is no dict
            aliases = json.loads(meta.get("kiln_aliases", "{}"))
        except Exception as err:  # safetensors raises its own error types for truncated files
            raise CheckpointError(f"{safe} is corrupt or truncated ({err}); resume from another checkpoint.") from None
        for alias, source in aliases.items():
            if source not in state:
                raise CheckpointError(
                    f"{safe} is damaged: tied weight {alias!r} points at {source!r}, which it does not hold."
                )
            state[alias] = state[source]
        return state
    if os.path.exists(os.path.join(directory, INDEX)):  # sharded (save_pretrained / save_model with max_shard_size)
        state, meta = load_sharded(directory)
        for alias, source in json.loads(meta.get("kiln_aliases", "{}")).items():
            if source not in state:
                raise CheckpointError(
                    f"{directory}/{INDEX} is damaged: tied weight {alias!r} points at {source!r}, which no shard holds."
                )
            state[alias] = state[source]
        return state
    binary = os.path.join(directory, WEIGHTS_BIN)
    if os.path.exists(binary):
        state = safe_torch_load(binary)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{binary} does not hold a state dict (a mapping of names to tensors).")
        return state
    raise CheckpointError(
        f"No model weights ({WEIGHTS_SAFE}, {INDEX} with its shards, or {WEIGHTS_BIN}) in {directory}."
    )


def apply_weights(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` into `module`, naming every missing, unexpected or mis-shaped key on mismatch.

    A model that overrides `load_state_dict` (e.g. it resizes a buffer grown during training) is
    loaded through its own method, as HF does: kiln's shape pre-check would wrongly refuse it."""
    if type(module).load_state_dict is not nn.Module.load_state_dict:
        try:
            module.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(
                f"{type(module).__name__}.load_state_dict refused the checkpoint {source} ({first})."
            ) from None
        return
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    # Tied weights HF's save_pretrained stores once (GPT-2's lm_head.weight is wte.weight): a key the
    # file lacks is fine when the model ties it to one the file has; loading that one fills both.
    where = _storage_key
    present = {where(own[k]) for k in own if k in state}
    tied = {k for k in missing if own[k].numel() and where(own[k]) in present}
    missing = [k for k in missing if k not in tied]
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(
        f"{k} (checkpoint {tuple(state[k].shape)}, model {tuple(own[k].shape)})"
        for k in set(own) & set(state)
        if tuple(own[k].shape) != tuple(state[k].shape)
    )
    if missing or unexpected or shapes:
        parts = []
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped keys", shapes)):
            if keys:
                shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
                parts.append(f"{label}: {shown}")
        raise CheckpointError(
            f"The checkpoint {source} does not fit this model ({'; '.join(parts)}). "
            "It was saved from a different model: resume with the model it was trained with, or start a fresh output_dir."
        )
    module.load_state_dict(state, strict=not tied)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's data lives, so that two names of one storage (a tie) compare equal. Device
    tensors without host-visible storage (XLA) are told apart by identity."""
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    except RuntimeError:
        return (id(t), 0, tuple(t.shape))


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


@register_format
class FullStateCheckpointIO(CheckpointIO):
    """Every rank holds the whole model: one writer saves it, every rank loads it. A full checkpoint
    loads on any number of processes."""

    format = "full"
    translatable = True
    reshardable = True

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        return load_weights(directory)

    @classmethod
    def portable(cls, directory: str) -> PortableState:
        return read_full_files(directory)

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
        if writer:
            _write_full(
                directory,
                module.state_dict(),
                optimizer.state_dict() if save_optimizer and optimizer is not None else None,
                safetensors,
            )

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
        """Host copies of the weights and optimizer state, written by the same code as `save`, so an
        asynchronous checkpoint holds the bytes a synchronous one would. A subclass that saves otherwise
        (XLA) must stage its own way: it saves synchronously until it does.

        The module's buffers (a forward pass changes some in place: BatchNorm's statistics) are copied
        now; the parameters and the optimizer state, which only the optimizer's step changes, on a thread
        of their own while the next step's forward and backward run, and that step waits for it
        (kiln.utils.host_copy)."""
        if not self.saves_in_background():
            return None
        if not writer:
            return lambda directory: None
        in_buffers = {b.untyped_storage().data_ptr() for b in module.buffers()}
        weights, optim = staging.copy(
            (module.state_dict(), optimizer.state_dict() if save_optimizer and optimizer is not None else None),
            later=lambda t: t.untyped_storage().data_ptr() not in in_buffers,
        )
        if optimizer is not None:
            staging.guard(optimizer)

        def write(directory: str) -> None:
            staging.wait()
            if staging.error is not None:
                raise CheckpointError(f"The checkpoint in {directory} was not written: {staging.error}.")
            _write_full(directory, weights, optim, safetensors)

        return write

    @classmethod
    def saves_in_background(cls) -> bool:
        return cls.save is FullStateCheckpointIO.save

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        if not load_optimizer or optimizer is None:
            return apply_weights(module, load_weights(directory), directory)
        self.load_portable(read_full_files(directory), module=module, optimizer=optimizer, source=directory)

    def load_portable(
        self, state: PortableState, *, module: nn.Module, optimizer: torch.optim.Optimizer | None, source: str
    ) -> None:
        apply_weights(module, state.weights, source)
        if optimizer is None:
            return
        saved = keyed_by_index(state.optimizer, optimizer_names(module, optimizer), source)
        try:
            optimizer.load_state_dict(regroup_optimizer_state(saved, optimizer.param_groups))
        except (ValueError, KeyError) as err:
            raise CheckpointError(
                f"The optimizer state in {source} does not fit this optimizer ({err}); "
                "was optim.name or the set of trainable parameters changed?"
            ) from None


def read_full_files(directory: str) -> PortableState:
    """The weights and `optimizer.pt` of a folder that holds them whole (formats `full` and `fsdp-full`)."""
    path = os.path.join(directory, OPTIMIZER)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: this checkpoint cannot be resumed (saved with save_only_model?).")
    return PortableState(load_weights(directory), safe_torch_load(path))


def _write_full(
    directory: str, weights: dict[str, torch.Tensor], optim: dict[str, Any] | None, safetensors: bool
) -> None:
    save_weights(weights, directory, safetensors)
    if optim is not None:
        torch.save(optim, os.path.join(directory, OPTIMIZER))
