"""The bitsandbytes optimizer names (`adamw_8bit`, `paged_lion_32bit`, `rmsprop_bnb_8bit`, ...) build the
class and keyword arguments HF's Trainer builds for the same name. bitsandbytes needs a GPU, so a stand-in
`bitsandbytes.optim` module records what each optimizer is constructed with; HF's own handler runs against
the same stand-in, so the comparison needs neither bitsandbytes nor a GPU."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from kiln.config.schema.optim import OptimConfig
from kiln.optim.optimizers import build_optimizer

transformers = pytest.importorskip("transformers")

NAMES = (
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "lion_32bit",
    "lion_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
)


def _stand_in(name: str) -> type:
    class Recorder(torch.optim.SGD):
        """Records its keyword arguments; steps like SGD so that build_optimizer can use it."""

        def __init__(self, params: Any, **kwargs: Any) -> None:
            self.kwargs = kwargs
            super().__init__(params, lr=kwargs["lr"])

    Recorder.__name__ = name
    return Recorder


@pytest.fixture
def fake_bnb(monkeypatch):
    optim = types.ModuleType("bitsandbytes.optim")
    for cls in ("AdamW", "Lion", "RMSprop", "AdEMAMix"):
        setattr(optim, cls, _stand_in(cls))
    package = types.ModuleType("bitsandbytes")
    package.optim = optim
    monkeypatch.setitem(sys.modules, "bitsandbytes", package)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", optim)
    handler = transformers.trainer._OPTIMIZER_HANDLERS["adamw_8bit"]
    monkeypatch.setitem(handler.__globals__, "is_bitsandbytes_available", lambda: True)
    return optim


@pytest.mark.parametrize("name", NAMES)
def test_bitsandbytes_names_build_hfs_optimizer(fake_bnb, name, tmp_path):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        optim=name,
        learning_rate=1e-3,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        report_to=[],
    )
    hf_cls, hf_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    optimizer = build_optimizer(
        nn.Linear(2, 2), OptimConfig(name=name, lr=1e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)
    )
    assert type(optimizer) is hf_cls
    assert optimizer.kwargs == hf_kwargs
    assert optimizer.kwargs["optim_bits"] == (8 if "8bit" in name else 32)
