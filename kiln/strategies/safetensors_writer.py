"""A safetensors file written without holding the GIL, for the checkpoint writer that runs while
training goes on (`save.async`).

`safetensors.torch.save_file` before 0.7 (kiln allows 0.4 and later) copies every tensor through numpy's
`tobytes` and writes the copies while it holds the GIL: measured with a real-time heartbeat thread, 0.32 s
of a 160 MB file's 0.33 s (0.6.2), so the training thread's Python stops for the whole write. This writes
the same file: the header's length (8 bytes, little-endian), the JSON header (`__metadata__`, then each
tensor's dtype, shape and data_offsets, compact, padded with spaces to a multiple of 8 bytes), then every
tensor's bytes straight from its memory with `os.write`, which releases the GIL for the system call and
copies nothing. Tensors are laid out as safetensors lays them out: by dtype, widest first, then by name.

The file is byte for byte the one `save_file` writes, but for the order of the `__metadata__` entries,
which safetensors writes in the order of a Rust hash map (different from one save to the next) and this
writes in the order given (tests/strategies/test_safetensors_writer.py)."""

from __future__ import annotations

import json
import os
import struct
import sys

import torch

#: safetensors' name of each dtype, widest first: the order of its `Dtype` enum, which sorts the tensors
_DTYPES = {
    dtype: name
    for dtype, name in (
        (torch.uint64, "U64"),
        (torch.int64, "I64"),
        (torch.float64, "F64"),
        (torch.complex64, "C64"),
        (torch.float32, "F32"),
        (torch.uint32, "U32"),
        (torch.int32, "I32"),
        (torch.bfloat16, "BF16"),
        (torch.float16, "F16"),
        (torch.uint16, "U16"),
        (torch.int16, "I16"),
        (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
        (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
        (torch.float8_e4m3fn, "F8_E4M3"),
        (torch.float8_e5m2, "F8_E5M2"),
        (torch.int8, "I8"),
        (torch.uint8, "U8"),
        (torch.bool, "BOOL"),
    )
}
_RANK = {dtype: rank for rank, dtype in enumerate(_DTYPES)}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (and the text `metadata`) to `path` as `safetensors.torch.save_file` would, holding
    the GIL only to build the header. A dtype this writer does not know, or a big-endian host (whose bytes
    safetensors swaps), is left to `save_file` itself."""
    if sys.byteorder != "little" or any(t.dtype not in _DTYPES for t in tensors.values()):
        from safetensors.torch import save_file

        save_file(tensors, path, metadata=metadata)
        return
    # the bytes as they lie in memory (a non-contiguous tensor copied first, as kiln's caller does)
    data = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    _refuse_overlaps(data)
    header: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    views = []
    offset = 0
    for name, tensor in sorted(data.items(), key=lambda item: (_RANK[item[1].dtype], item[0])):
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        if size:  # a view of the tensor's memory, no copy (it keeps the tensor alive)
            views.append(tensor.reshape(-1).view(torch.uint8).numpy().data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(text)) + text))
        for view in views:
            _write_all(fd, view)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:  # a write may be short (Linux writes at most 2 GiB at a time)
        view = view[os.write(fd, view) :]


def _refuse_overlaps(tensors: dict[str, torch.Tensor]) -> None:
    """Raise, as safetensors does, when two tensors overlap in memory: the file would hold their shared
    bytes twice and load them as two tensors. Views of one storage that do not overlap are fine."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in tensors.items() if t.numel()
    )
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:]):
        if start < end:  # sorted by start: an overlap shows between neighbours
            raise ValueError(
                f"The tensors {name!r} and {next_name!r} overlap in memory, which a safetensors file cannot hold: "
                "give the model one of them only (rebuild the view after loading) or give each its own storage (.clone())."
            )
