"""The start-up summary counts a ZeRO-3-partitioned parameter at its full size (`ds_numel`), not the
empty tensor left in the module: the issue-34 report was a ZeRO-3 run announcing "0 parameters"."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from kiln.engine.model.summary import model_summary


def test_partitioned_parameters_are_counted_at_full_size():
    model = nn.Linear(4, 3)
    for p in model.parameters():  # what deepspeed.zero.Init leaves: an empty local tensor, the size aside
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    line = model_summary(
        model,
        SimpleNamespace(name="deepspeed", root_device=torch.device("cpu"), world_size=1),
        SimpleNamespace(name="fp32", param_dtype=torch.float32, compute_dtype=torch.float32),
    )
    assert line.startswith("model Linear: 15 parameters (15 trainable")
