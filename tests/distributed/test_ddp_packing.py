"""data.packing on 2 real processes (gloo): over a dataset every rank plans the same rows and kiln's sampler
deals them out, so the run ends with the weights of one process training on the global batch; over a
stream each rank reads every other example and packs its own rows."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import packing_toy, toy
from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("packing")
    torchrun("worker_packing.py", out, timeout=300)
    return json.loads((out / "results.json").read_text()), load_file(str(out / "results.safetensors"))


def test_two_ranks_of_packed_rows_match_one_process_on_the_global_batch(ddp, tmp_path):
    results, tensors = ddp
    assert results["rows"]["ranks_identical"] and results["rows"]["steps"] == 2
    trainer = packing_toy.train(str(tmp_path), world=1)
    torch.testing.assert_close(tensors["rows"], toy.flat_params(trainer.model), atol=1e-5, rtol=0)
    first = results["rows"]["first_batches"]
    assert first[0] != first[1]  # each rank trained on its own rows


def test_each_rank_packs_its_own_share_of_a_stream(ddp):
    results, _ = ddp
    assert results["stream"]["ranks_identical"] and results["stream"]["steps"] == 2
    first = results["stream"]["first_batches"]
    assert first[0] != first[1]
