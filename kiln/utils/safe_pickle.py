"""Vetting the pickles inside torch's distributed checkpoints (DCP) before torch reads them.

kiln promises that loading a checkpoint never runs code from it, but DCP's `FileSystemReader` reads
`.metadata` with plain `pickle.load`, and its default load planners read every non-tensor entry (an
optimizer's `lr`, `betas`, ...) from the `.distcp` files with `torch.load(weights_only=False)`. Either
lets a planted `__reduce__` run on resume or `kiln convert`. So before any `dcp.load`, `read_metadata`
or consolidation, `vet_dcp_folder` reads those same bytes itself, with an unpickler that builds only
DCP's own metadata classes and plain containers, and `torch.load(weights_only=True)` for the non-tensor
entries; anything else is refused with a CheckpointError and nothing from the file runs. (DCP already
reads the tensor entries with `weights_only=True`.)

Only `pickle` and kiln's errors are imported here; torch is imported inside the functions."""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from kiln.utils.errors import CheckpointError, _reason

#: the classes DCP's FileSystemWriter pickles into `.metadata` (seen in real files of torch 2.x)
DCP_METADATA_CLASSES: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "BytesStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
        ("collections", "OrderedDict"),
        *(("builtins", name) for name in ("set", "frozenset", "complex", "slice", "bytearray")),
        *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
    }
)

WHAT_DCP_HOLDS = "torch's distributed-checkpoint metadata, tensors and plain containers"


class UnsafePickle(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (never imported, never called)."""


def _torch_constant(name: str) -> bool:
    """torch.float32, torch.strided, torch.contiguous_format...: values that pickle as a bare global."""
    import torch

    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class DCPMetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP's metadata classes, torch's dtype/layout/memory-format
    constants and plain containers. Dotted names are refused outright: pickle would otherwise walk
    attributes (`metadata.os.system`) from an allowed module."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and (
            (module, name) in DCP_METADATA_CLASSES or (module == "torch" and _torch_constant(name))
        ):
            return super().find_class(module, name)
        raise UnsafePickle(f"global {module}.{name} is not allowed")


def _refusal(path: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"Refusing to load {path}: it holds Python objects other than {WHAT_DCP_HOLDS} ({reason}); "
        "kiln never executes code from a checkpoint, so re-create it with kiln."
    )


def load_dcp_metadata(path: str) -> Any:
    """The `Metadata` object pickled in `path` (a DCP `.metadata` file), unpickled without running code."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as fh:
            meta = DCPMetadataUnpickler(fh).load()
    except UnsafePickle as err:
        raise _refusal(path, str(err)) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, so this is not a complete distributed checkpoint.") from None
    except Exception as err:  # truncated or garbled: EOFError, UnpicklingError, TypeError from a constructor...
        raise CheckpointError(f"{path} is corrupt or truncated ({type(err).__name__}: {str(err)[:200]}).") from None
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"{path} is not distributed-checkpoint metadata (it holds a {type(meta).__name__}).")
    return meta


def _vet_bytes_entry(folder: str, fqn: str, info: Any) -> None:
    """Read one non-tensor entry as DCP will, but with `weights_only=True`."""
    import torch

    path = os.path.join(folder, info.relative_path)
    where = f"{path} (entry {fqn})"
    if info.transform_descriptors:  # kiln writes no stream transforms (compression...); nothing else is vetted
        raise CheckpointError(
            f"Refusing to load {where}: it is stored through stream transforms "
            f"{list(info.transform_descriptors)}, which kiln does not write or vet."
        )
    try:
        with open(path, "rb") as fh:
            fh.seek(info.offset)
            data = fh.read(info.length)
    except OSError as err:
        raise CheckpointError(f"{path} is missing or unreadable ({err.strerror}).") from None
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refusal(where, _reason(err)) from None
    except Exception as err:
        raise CheckpointError(f"{where} is corrupt or truncated ({type(err).__name__}).") from None


def vet_dcp_folder(folder: str) -> Any:
    """Check every pickle torch's DCP would read from `folder` (its `.metadata`, any per-rank
    `__<rank>.metadata`, and the non-tensor entries of the `.distcp` files); returns the vetted
    `Metadata`. Call it right before handing the folder to `dcp.load` or a `FileSystemReader`."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is missing, so this is not a sharded checkpoint.")
    meta = load_dcp_metadata(os.path.join(folder, ".metadata"))
    for name in sorted(os.listdir(folder)):
        if name.endswith(".metadata") and name != ".metadata":
            load_dcp_metadata(os.path.join(folder, name))
    storage = meta.storage_data if isinstance(meta.storage_data, dict) else {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if isinstance(fqn, str) and isinstance(meta.state_dict_metadata.get(fqn), BytesStorageMetadata):
            _vet_bytes_entry(folder, fqn, info)
    return meta


def weights_only_refusal(err: BaseException) -> bool:
    """Whether a DCP load failure is torch refusing a tensor entry with `weights_only=True` (a pickle
    holding more than a tensor), so the caller can say that rather than "does not fit this model"."""
    text = str(err)
    return "Weights only load failed" in text or "WeightsUnpickler" in text


def dcp_load_error(path: str, err: BaseException, with_optim: bool) -> CheckpointError:
    """One sentence for a failed `dcp.load` of the folder `path` (DCP wraps per-rank failures in its own
    exception types, whose first line is the useful part)."""
    if weights_only_refusal(err):  # torch refused a tensor entry that pickles more than a tensor
        return CheckpointError(
            f"Refusing to load {path}: a .distcp file holds Python objects other than a tensor "
            "where a tensor belongs; kiln never executes code from a checkpoint, so re-create it with kiln."
        )
    what = (
        "has no optimizer state (saved with save_only_model?)"
        if with_optim and "optim" in str(err)
        else "does not fit this model"
    )
    first = (str(err) or type(err).__name__).splitlines()[0][:300]
    return CheckpointError(f"The sharded checkpoint {path} {what} ({first}).")
