"""The XLA device loader stays transparent to the loop (length, sampler, epoch hooks are the wrapped
DataLoader's), and a short last batch (one more XLA compilation) is found and reported once.
Runs without torch_xla: only iterating needs it."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader

from kiln.strategies.xla.loader import XLADeviceLoader, short_last_batch, static_shape_warning


def test_the_wrapper_looks_like_the_loader_it_wraps():
    loader = DataLoader(list(range(10)), batch_size=4, shuffle=True, generator=torch.Generator())
    wrapped = XLADeviceLoader(loader, torch.device("cpu"))
    assert len(wrapped) == 3
    assert wrapped.sampler is loader.sampler and wrapped.batch_size == 4 and wrapped.generator is loader.generator


def test_a_short_last_batch_is_found_and_reported(caplog):
    assert short_last_batch(DataLoader(list(range(10)), batch_size=4)) == (2, 4)
    assert short_last_batch(DataLoader(list(range(10)), batch_size=4, drop_last=True)) is None
    assert short_last_batch(DataLoader(list(range(12)), batch_size=4)) is None
    with caplog.at_level(logging.WARNING, logger="kiln.strategies.xla.loader"):
        static_shape_warning(DataLoader(list(range(10)), batch_size=4))
    assert "2 rows instead of 4" in caplog.text and "drop_last=True" in caplog.text
