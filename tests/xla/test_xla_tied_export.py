"""On a real XLA device (PJRT CPU) a tied weight is stored once in the checkpoint and the export:
each XLA->host copy makes new storage, so only one copy per tie object keeps the safetensors writer
from storing it twice. The CPU-side identity check is tests/strategies/test_xla_checkpoint_tied_weights.py;
this one runs in the XLA environment (scripts/xla-env.sh) and skips elsewhere."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch_xla")

import torch_xla.core.xla_model as xm  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch import nn  # noqa: E402

from kiln.strategies.xla_checkpoint_io import XLACheckpointIO, module_state_cpu  # noqa: E402


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


def test_a_tied_weight_on_an_xla_device_is_saved_once(tmp_path):
    model = Tied().to(xm.xla_device())
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "xla"
    state = module_state_cpu(model)  # what the export (model_state_for_export) writes
    assert state["emb.weight"] is state["head.weight"] and state["emb.weight"].device.type == "cpu"
    XLACheckpointIO().save(str(tmp_path), model=model, module=model, optimizer=None, save_optimizer=False,
                           safetensors=True, writer=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        keys, meta = list(fh.keys()), fh.metadata()
    assert keys == ["emb.weight"] and json.loads(meta["kiln_aliases"]) == {"head.weight": "emb.weight"}
