"""Batch helpers: moving a nested batch to the device keeps its structure, and a tensor already on the
device is not sent through `.to()` (a per-step dispatcher trip on the hot path)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from kiln.utils.tensors import batch_size_of, move_to_device

Pair = namedtuple("Pair", "x y")


def _spy_to(monkeypatch) -> list[torch.device]:
    calls: list[torch.device] = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        calls.append(args[0] if args else kwargs.get("device"))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    return calls


def test_tensor_already_on_the_device_is_returned_without_calling_to(monkeypatch):
    calls = _spy_to(monkeypatch)
    batch = {"x": torch.ones(2, 3), "y": [torch.zeros(2), (torch.arange(2),)], "n": 3}
    moved = move_to_device(batch, torch.device("cpu"))
    assert calls == []
    assert moved["x"] is batch["x"] and moved["y"][0] is batch["y"][0] and moved["y"][1][0] is batch["y"][1][0]
    assert moved["n"] == 3


def test_tensor_on_another_device_is_moved_and_structure_kept(monkeypatch):
    calls = _spy_to(monkeypatch)
    batch = OrderedDict(a=Pair(torch.ones(4, 1), torch.zeros(4)), b=[torch.ones(4)])
    moved = move_to_device(batch, torch.device("meta"))
    assert len(calls) == 3
    assert type(moved) is OrderedDict and type(moved["a"]) is Pair and type(moved["b"]) is list
    assert all(t.device.type == "meta" for t in (moved["a"].x, moved["a"].y, moved["b"][0]))
    assert batch_size_of(moved) == 4


def test_a_dict_batch_already_on_the_device_is_returned_as_is_and_a_mixed_one_is_copied(monkeypatch):
    calls = _spy_to(monkeypatch)
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.zeros(2)}
    assert move_to_device(batch, torch.device("cpu")) is batch and calls == []  # no new dict every step
    mixed = {"x": torch.ones(2), "y": torch.ones(2, device="meta"), "n": 3}
    moved = move_to_device(mixed, torch.device("meta"))
    assert moved is not mixed and mixed["x"].device.type == "cpu"  # the loader's dict is left as it was
    assert moved["x"].device.type == "meta" and moved["y"] is mixed["y"] and moved["n"] == 3 and len(calls) == 1
