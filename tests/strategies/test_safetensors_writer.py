"""kiln's own safetensors writer (the background save's: it holds no GIL while it writes) writes the
bytes `safetensors.torch.save_file` writes, for every dtype, 0-d and empty tensors, non-contiguous and
tied tensors as kiln passes them; only the order of the `__metadata__` entries may differ, which
safetensors itself writes in a Rust hash map's order."""

from __future__ import annotations

import json
import os
import struct

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors.torch import save_file

from kiln.strategies import model_weights, safetensors_writer
from kiln.strategies.model_weights import WEIGHTS_SAFE, load_weights, save_weights
from kiln.strategies.safetensors_writer import write_safetensors


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _same_file(a: bytes, b: bytes) -> bool:
    """Byte for byte, but for the order of the entries inside `__metadata__` (the header's first object)."""
    if a == b:
        return True
    (n,) = struct.unpack("<Q", a[:8])
    if a[:8] != b[:8] or a[8 + n :] != b[8 + n :]:
        return False
    head_a, head_b = a[8 : 8 + n].decode(), b[8 : 8 + n].decode()
    start = len('{"__metadata__":')
    if not (head_a.startswith('{"__metadata__":') and head_b.startswith('{"__metadata__":')):
        return False
    decoder = json.JSONDecoder()
    meta_a, end_a = decoder.raw_decode(head_a, start)
    meta_b, end_b = decoder.raw_decode(head_b, start)
    return meta_a == meta_b and head_a[end_a:] == head_b[end_b:]


def _both(tmp_path, tensors, metadata=None) -> tuple[bytes, bytes]:
    ours, theirs, plain = (str(tmp_path / name) for name in ("ours.safetensors", "theirs.safetensors", "plain"))
    write_safetensors(tensors, ours, metadata=metadata)
    save_file(tensors, theirs, metadata=metadata)
    open(plain, "w").close()
    # the mode of every other checkpoint file (0666 less the umask; safetensors 0.8 makes its files 0600)
    assert os.stat(ours).st_mode == os.stat(plain).st_mode
    return _read(ours), _read(theirs)


def _writable(tensor: torch.Tensor) -> bool:
    """Whether the installed safetensors writes this dtype (before 0.7 it lacks complex64 and the fnuz float8s)."""
    try:
        safetensors.torch.save({"x": tensor})
    except (KeyError, ValueError, TypeError):
        return False
    return True


def _every_dtype() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "fp32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).bfloat16(),
        "fp16": torch.randn(2, 3, generator=gen).half(),
        "int64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),  # 0-d
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(0, dtype=torch.bfloat16),
        "fp64": torch.randn(2, generator=gen).double(),
    }
    for dtype in safetensors_writer._DTYPES:  # the rest of the table, 9 elements each: the offsets move oddly
        tensors.setdefault(str(dtype).split(".")[-1], torch.arange(9, dtype=torch.uint8).to(dtype))
    return {name: t for name, t in tensors.items() if _writable(t)}


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {}])
def test_every_dtype_0d_and_empty_tensors_are_byte_identical(tmp_path, metadata):
    tensors = _every_dtype()
    if tuple(int(part) for part in safetensors.__version__.split(".")[:2]) >= (0, 7):
        assert {t.dtype for t in tensors.values()} == set(safetensors_writer._DTYPES)
    ours, theirs = _both(tmp_path, tensors, metadata)
    assert ours == theirs


def test_names_that_need_escaping_and_header_padding_are_byte_identical(tmp_path):
    for length in range(1, 10):  # every header length modulo 8
        tensors = {"x" * length: torch.ones(1), 'quote"back\\slash\ttab\x01ünï€': torch.zeros(2, dtype=torch.int8)}
        ours, theirs = _both(tmp_path, tensors, {"note": 'a "quoted"\nline ü'})
        assert ours == theirs


def test_a_short_write_is_continued(tmp_path, monkeypatch):
    real = os.write
    monkeypatch.setattr(safetensors_writer.os, "write", lambda fd, data: real(fd, data[:7]))  # 7 bytes at a time
    ours, theirs = _both(tmp_path, {"a": torch.randn(10), "b": torch.arange(3)}, {"format": "pt"})
    assert ours == theirs


def test_a_longer_file_in_its_place_is_replaced_not_overwritten_in_part(tmp_path):
    ours, theirs = tmp_path / "ours.safetensors", str(tmp_path / "theirs.safetensors")
    ours.write_bytes(b"\xff" * 4096)
    write_safetensors({"a": torch.ones(2)}, str(ours))
    save_file({"a": torch.ones(2)}, theirs)
    assert ours.read_bytes() == _read(theirs)


def _kiln_state() -> dict[str, torch.Tensor]:
    """A state dict as kiln's staged copy hands it over: a tie (one tensor under two names), two
    parameters that are non-overlapping views of one storage, a non-contiguous (transposed) one."""
    flat = torch.randn(12)
    embed = torch.randn(4, 3)
    return {
        "embed.weight": embed,
        "head.weight": embed,  # tied
        "a.weight": flat[:6].view(2, 3),
        "b.weight": flat[6:].view(3, 2),
        "t.weight": torch.randn(3, 5).t(),  # non-contiguous
        "norm.bias": torch.zeros(3, dtype=torch.bfloat16),
        "steps": torch.tensor(7),
    }


def test_kiln_s_background_weights_are_the_synchronous_ones(tmp_path):
    sync, background = tmp_path / "sync", tmp_path / "background"
    sync.mkdir(), background.mkdir()
    state = _kiln_state()
    save_weights(state, str(sync))
    save_weights(state, str(background), in_background=True)
    assert _same_file(_read(str(background / WEIGHTS_SAFE)), _read(str(sync / WEIGHTS_SAFE)))
    loaded = load_weights(str(background))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())
    assert loaded["head.weight"] is loaded["embed.weight"]  # stored once, the alias restored


def test_tensors_that_overlap_in_memory_are_refused_as_safetensors_refuses_them(tmp_path):
    base = torch.randn(10)
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"a": base[:6], "b": base[4:]}, str(tmp_path / "theirs.safetensors"))
    with pytest.raises(ValueError, match="'a' and 'b' overlap in memory"):
        write_safetensors({"a": base[:6], "b": base[4:]}, str(tmp_path / "ours.safetensors"))
    ours, theirs = _both(tmp_path, {"a": base[:5], "b": base[5:]})  # adjacent views are fine
    assert ours == theirs


def test_a_dtype_it_does_not_know_or_a_big_endian_host_is_left_to_safetensors(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("safetensors.torch.save_file", lambda *a, **kw: calls.append(a[1]))
    complex_file, big_file = str(tmp_path / "complex.safetensors"), str(tmp_path / "big.safetensors")
    write_safetensors({"c": torch.zeros(2, dtype=torch.complex128), "a": torch.zeros(2)}, complex_file)
    monkeypatch.setattr(safetensors_writer.sys, "byteorder", "big")
    write_safetensors({"a": torch.zeros(2)}, big_file)
    assert calls == [complex_file, big_file]
    assert not os.listdir(tmp_path)  # nothing written by kiln's writer


def test_the_background_save_writes_with_kiln_s_writer_and_the_synchronous_one_with_safetensors(tmp_path, monkeypatch):
    from torch import nn

    from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
    from kiln.utils.host_copy import HostStaging

    used = []
    real = model_weights.write_safetensors
    monkeypatch.setattr(model_weights, "write_safetensors", lambda *a, **kw: (used.append("kiln"), real(*a, **kw)))
    monkeypatch.setattr("safetensors.torch.save_file", lambda *a, **kw: used.append("safetensors"))
    model = nn.Linear(2, 2)  # no optimizer: building the first one costs a test seconds (torch's lazy imports)
    kw = {"model": model, "module": model, "optimizer": None, "save_optimizer": False, "safetensors": True}
    io = FullStateCheckpointIO()
    io.save(str(tmp_path), writer=True, **kw)
    assert used == ["safetensors"]
    io.stage(str(tmp_path), writer=True, staging=HostStaging(), **kw)(str(tmp_path))
    assert used == ["safetensors", "kiln"]
    save_weights(model.state_dict(), str(tmp_path))  # export, convert, the other formats: safetensors' own
    assert used == ["safetensors", "kiln", "safetensors"]
