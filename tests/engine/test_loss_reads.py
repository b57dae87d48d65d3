"""The queued losses read back at a log step: the same floats on every device path."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.loop.loss_reads import loss_values


def test_host_losses_read_as_the_stacked_read_would():
    losses = [torch.tensor(1 / 3), torch.tensor([2 / 3]), torch.tensor(float("nan")), torch.tensor(1e-8)]
    values = loss_values(losses)
    expected = torch.stack([loss.reshape(()) for loss in losses]).tolist()
    assert values[:2] + values[3:] == expected[:2] + expected[3:] and values[2] != values[2]
    assert all(type(v) is float for v in values)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_losses_come_back_in_one_transfer():
    for shape in ((), (1,)):  # a custom step may return shape (1,)
        losses = [torch.full(shape, i / 7, device="cuda") for i in range(10)]
        assert loss_values(losses) == [loss.item() for loss in losses]
