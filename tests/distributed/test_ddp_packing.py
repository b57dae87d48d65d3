"""data.packing on 2 real processes (gloo): over a dataset every rank plans the same rows and kiln's sampler
deals them out, so the run ends with the weights of one process training on the global batch; over a
stream each rank reads every other example and packs its own rows. The same world runs the packed rows with
the chunked loss and selective activation checkpointing under DDP, and again under FSDP (each rank packs its
own rows as under DDP; the loss reads the LM head FSDP gathered): still one process's weights."""

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


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return toy.flat_params(packing_toy.train(str(tmp_path_factory.mktemp("one")), world=1).model)


def test_two_ranks_of_packed_rows_match_one_process_on_the_global_batch(ddp, one_process):
    results, tensors = ddp
    assert results["rows"]["ranks_identical"] and results["rows"]["steps"] == 2
    torch.testing.assert_close(tensors["rows"], one_process, atol=1e-5, rtol=0)
    first = results["rows"]["first_batches"]
    assert first[0] != first[1]  # each rank trained on its own rows


def test_each_rank_packs_its_own_share_of_a_stream(ddp):
    results, _ = ddp
    assert results["stream"]["ranks_identical"] and results["stream"]["steps"] == 2
    first = results["stream"]["first_batches"]
    assert first[0] != first[1]


def test_the_chunked_loss_and_checkpointing_under_ddp_match_one_process_without_them(ddp, one_process):
    results, tensors = ddp
    run = results["chunked"]
    assert run["ranks_identical"] and run["steps"] == 2
    assert run["chunked"] and run["checkpointed"] == 2 and results["rows"]["checkpointed"] == 0
    torch.testing.assert_close(tensors["chunked"], one_process, atol=1e-5, rtol=0)


def test_packed_rows_under_fsdp_with_the_chunked_loss_match_one_process(ddp, one_process):
    results, tensors = ddp
    run = results["fsdp"]
    assert run["steps"] == 2 and run["chunked"] and run["checkpointed"] == 2
    first = run["first_batches"]
    assert first[0] != first[1]  # each rank packed and trained its own rows
    torch.testing.assert_close(tensors["fsdp"], one_process, atol=1e-5, rtol=0)
