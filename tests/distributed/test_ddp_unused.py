"""find_unused_parameters left unset: chosen on the first step. A model with unused parameters trains
(the same weights as with the flag forced on, and as one process with the doubled batch); one
without them runs with the flag off and never sees torch's warning; one line says which."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import toy
from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.distributed


def test_unset_find_unused_parameters_is_chosen_on_the_first_step(tmp_path):
    proc = torchrun("worker_unused.py", tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    tensors = load_file(str(tmp_path / "results.safetensors"))
    assert results["auto"]["find_unused"] is True and results["all_used"]["find_unused"] is False
    assert all(r["ranks_identical"] for r in results.values())
    assert results["auto"]["unused_grad_is_none"] is True
    torch.testing.assert_close(tensors["auto"], tensors["forced"], rtol=0, atol=0)
    torch.manual_seed(0)
    single = toy.WithUnused()
    trainer_cfg = toy.scenario_config("accum", str(tmp_path / "single"), world=1)
    from kiln import Trainer

    Trainer(single, trainer_cfg, train_dataset=toy.regression_data(32)).fit()
    torch.testing.assert_close(tensors["auto"], toy.flat_params(single), rtol=1e-5, atol=1e-6)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("kiln: DDP:")]
    assert lines == [
        "kiln: DDP: 2 parameter(s) got no gradient in the first step (unused.weight, unused.bias); find_unused_parameters "
        "is on (set strategy.find_unused_parameters: false if they are frozen by mistake)",
        "kiln: DDP: every parameter got a gradient in the first step; find_unused_parameters is off "
        "(set strategy.find_unused_parameters: true if later steps leave some out)",
    ]
    assert "find_unused_parameters=True was specified" not in proc.stderr  # torch's warning
