"""Packed rows under context parallelism without a process group (kiln/strategies/mesh/packed_cp.py and
`prepare_batch(..., packed=True)`): examples read from position_ids, rows padded for the split, the
per-example mask of a rank's queries over the gathered keys (checked against the whole row's
block-diagonal causal mask), what a packed batch keeps and drops, and the model checks. The gathered
attention itself trains in test_cp_packing.py's 2-process world."""

from __future__ import annotations

import pytest
import torch

from kiln.strategies.mesh.context_parallel import check_model, chunk_indices, prepare_batch
from kiln.strategies.mesh.packed_cp import documents, gathered_mask, pad_rows
from kiln.utils.errors import ConfigError
from tests.strategies.model_parallel.cases import llama

#: one row of 10 tokens: examples of 3, 2, 4 and 1 tokens (the collator restarts positions at each)
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]])
IDS = torch.arange(10).view(1, 10) + 20


def test_an_example_starts_where_position_ids_stop_counting_on():
    assert documents(POSITIONS).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3, 4]]
    assert documents(torch.tensor([[0, 1, 2, 3], [5, 6, 0, 1]])).tolist() == [[1, 1, 1, 1], [1, 1, 2, 2]]


def test_rows_are_padded_to_the_split_as_one_more_example():
    batch = {"input_ids": IDS, "labels": IDS, "position_ids": POSITIONS, "row": torch.ones(1)}
    out, length = pad_rows(batch, 1, 10, 4)
    assert length == 12 and out["row"] is batch["row"]
    assert out["input_ids"][0, 10:].tolist() == [0, 0] and out["labels"][0, 10:].tolist() == [-100, -100]
    assert out["position_ids"][0, 10:].tolist() == [0, 1]
    assert pad_rows(batch, 1, 10, 5) == (batch, 10)  # already divisible: untouched


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("cp", [2, 3])
def test_each_ranks_mask_is_its_rows_of_the_whole_block_diagonal_causal_mask(cp, load_balance):
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    docs = documents(positions)
    whole = (docs[:, :, None] == docs[:, None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    order = torch.cat([chunk_indices(12, cp, r, load_balance) for r in range(cp)])
    for rank in range(cp):
        keep = chunk_indices(12, cp, rank, load_balance)
        mask = gathered_mask(docs, keep, order)
        assert mask.shape == (2, 1, 12 // cp, 12)
        assert torch.equal(mask[:, 0], whole[:, keep][:, :, order])


def test_a_packed_batch_keeps_its_positions_drops_the_varlen_arguments_and_gets_the_mask():
    labels = IDS.clone()
    labels[0, [0, 3, 5, 9]] = -100  # the collator's: no example's first token is a target
    batch = {
        "input_ids": IDS,
        "labels": labels,
        "position_ids": POSITIONS[0],  # broadcast over the rows, as a collator may give them
        "cu_seq_lens_q": torch.tensor([0, 3, 5, 9, 10]),
        "cu_seq_lens_k": torch.tensor([0, 3, 5, 9, 10]),
        "max_length_q": 4,
        "max_length_k": 4,
    }
    parts = [prepare_batch(batch, 2, rank, True, packed=True) for rank in range(2)]
    for part in parts:
        assert set(part) == {"input_ids", "labels", "shift_labels", "position_ids", "attention_mask"}
        assert part["attention_mask"].shape == (1, 1, 6, 12) and part["attention_mask"].dtype == torch.bool
    # rank 0 keeps pieces 0 and 3 of 12 tokens (10 and 2 of padding), rank 1 pieces 1 and 2
    assert parts[0]["input_ids"].tolist() == [[20, 21, 22, 29, 0, 0]]
    assert parts[0]["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert parts[1]["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]]
    # each example's last token has no target: the next example's first label is -100
    assert parts[0]["shift_labels"].tolist() == [[21, 22, -100, -100, -100, -100]]
    assert parts[1]["shift_labels"].tolist() == [[24, -100, 26, 27, 28, -100]]


def test_an_unpacked_batch_under_packed_cp_is_one_example_per_row():
    out = prepare_batch({"input_ids": IDS[:, :8]}, 2, 0, True, packed=True)
    assert out["position_ids"].tolist() == [[0, 1, 6, 7]]
    # the query at 6 over the gathered keys at 0, 1, 6, 7 (rank 0's) and 2, 3, 4, 5 (rank 1's): causal
    assert out["attention_mask"][0, 0, 2].tolist() == [True, True, True, False, True, True, True, True]


def _llama(impl: str):
    model = llama()
    model.config._attn_implementation = impl
    return model


def test_packed_cp_takes_sdpa_on_cpu_and_keeps_the_mask():
    model = _llama("sdpa")
    assert check_model(model, "cpu", packed=True) == 0  # no hook dropping the attention mask
    assert not any(getattr(m, "_kiln_cp_causal", False) for m in model.modules())


@pytest.mark.parametrize("impl", ["eager", "flex_attention", "flash_attention_2"])
def test_packed_cp_refuses_other_attention_in_one_sentence(impl):
    with pytest.raises(
        ConfigError,
        match=rf"^LlamaForCausalLM uses '{impl}' attention, but under context parallel kiln attends packed rows "
        r"\(data.packing\) through SDPA over the gathered keys and values of the cp ranks; load it with "
        r"attn_implementation='sdpa'.$",
    ):
        check_model(_llama(impl), "cuda", packed=True)


@pytest.mark.parametrize(
    "data, packed",
    [
        ({}, False),
        ({"packing": {"strategy": "bfd", "max_length": 16}}, True),
        ({"packing": {"padding_free": True}}, True),
        ({"packing": {"padding_free": False}}, False),
    ],
)
def test_the_strategy_gathers_for_packed_rows_only(data, packed):
    """Rows are packed when data.packing packs (a strategy) or concatenates (padding_free), as the
    Trainer's loaders decide; everything else keeps the ring."""
    from types import SimpleNamespace

    from kiln.config import load_config
    from kiln.strategies.mesh.strategy import MeshStrategy

    cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu"}, "data": data})
    assert MeshStrategy.cp_packed.fget(SimpleNamespace(config=cfg)) is packed
    assert MeshStrategy.cp_packed.fget(SimpleNamespace(config=None)) is False


@pytest.mark.parametrize(
    "cp, packed, entered", [(2, True, "gathered"), (2, False, "ring"), (1, True, None), (1, False, None)]
)
def test_a_micro_batch_runs_in_the_attention_its_rows_need(monkeypatch, cp, packed, entered):
    """Packed rows gather under cp; other rows go round the ring (CUDA only, so its own world cannot run
    here); with cp 1 neither."""
    import contextlib
    from types import SimpleNamespace

    from kiln.strategies.mesh import context_parallel, packed_cp
    from kiln.strategies.mesh.strategy import MeshStrategy

    seen = []

    def recorder(name):
        @contextlib.contextmanager
        def enter(mesh, *args):
            seen.append((name, mesh))
            yield

        return enter

    monkeypatch.setattr(packed_cp, "gathered_attention", recorder("gathered"))
    monkeypatch.setattr(context_parallel, "ring_attention", recorder("ring"))
    strategy = SimpleNamespace(
        shape=SimpleNamespace(cp=cp),
        cp_packed=packed,
        cp_load_balance=True,
        device_mesh={"cp": "cp-mesh"},
        unwrap=lambda model: model,
        _loss_parallel=None,
    )
    with MeshStrategy.micro_batch_context(strategy, torch.nn.Linear(1, 1), boundary=True):
        pass
    assert seen == ([(entered, "cp-mesh")] if entered else [])
