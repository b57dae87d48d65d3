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

from kiln.strategies.xla.checkpoint_io import XLACheckpointIO, module_state_cpu  # noqa: E402


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


def test_a_tied_weight_on_an_xla_device_is_saved_once(tmp_path):
    model = Tied().to(xm.xla_device())
    model.head.weight = model.emb.weight  # moving to XLA makes new Parameters; kiln's XLA strategy re-ties them
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "xla"
    state = module_state_cpu(model)  # what the export (model_state_for_export) writes
    assert state["emb.weight"] is state["head.weight"] and state["emb.weight"].device.type == "cpu"
    XLACheckpointIO().save(
        str(tmp_path), model=model, module=model, optimizer=None, save_optimizer=False, safetensors=True, writer=True
    )
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        keys, meta = list(fh.keys()), fh.metadata()
    assert keys == ["emb.weight"] and json.loads(meta["kiln_aliases"]) == {"head.weight": "emb.weight"}


class TiedLM(Tied):
    """HF contract: model(**batch) returns a loss; the head shares the embedding's weight."""

    def forward(self, input_ids, labels):  # type: ignore[no-untyped-def]
        return {"loss": nn.functional.cross_entropy(self.head(self.emb(input_ids)).flatten(0, 1), labels.flatten())}


def test_training_on_xla_keeps_a_tie_one_parameter(tmp_path):
    """Moving a module to an XLA device makes new Parameters (no shallow copy between CPU and XLA
    tensors), one per name: without re-tying, the head and the embedding would train apart."""
    import torch

    from kiln import Trainer

    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(0, 5, (3,)), "labels": torch.randint(0, 5, (3,))} for _ in range(16)]
    trainer = Trainer(
        TiedLM(),
        {
            "output_dir": str(tmp_path / "run"),
            "strategy": "xla",
            "max_steps": 3,
            "report_to": "none",
            "per_device_train_batch_size": 4,
            "save_strategy": "no",
            "disable_tqdm": True,
        },
        train_dataset=data,
    )
    trainer.fit()
    model = trainer.model
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "xla"
    assert len(list(model.parameters())) == 1
