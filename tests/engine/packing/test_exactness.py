"""A packed forward scores every token as the unpacked (padded) forward does: tiny Llama, Qwen2, Mistral,
GPT-2 and BERT built from configs, with sdpa and eager attention, padded rows and padding-free rows, every
packing strategy; flex_attention's forward, and flash-attention's varlen contract through a CPU reference
kernel. The loss the model computes from the packed labels, and the item count kiln passes it, are the
unpacked ones: no token is trained to predict the next example's first token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.engine.data.packing import packed_training_data
from kiln.engine.model.module import item_counter
from tests.engine.packing import tiny

pytest.importorskip("transformers")

ONE_PROCESS = SimpleNamespace(data_shards=1, data_shard_rank=0, item_shards=1)


def data_cfg(strategy="bfd", max_length=24, padding_free=None, **data):
    data = {"group_by_length": False, "dispatch_batches": False, **data}
    return SimpleNamespace(
        packing=SimpleNamespace(strategy=strategy, max_length=max_length, padding_free=padding_free), **data
    )


def pack(model, examples, strategy="bfd", max_length=24, padding_free=None):
    """Every row of `examples` packed into one batch, and each row's pieces."""
    rows, collator = packed_training_data(
        examples,
        None,
        user_collator=None,
        model=model,
        training_module=False,
        data_cfg=data_cfg(strategy, max_length, padding_free),
        strategy=ONE_PROCESS,
    )
    return collator([rows[i] for i in range(len(rows))]), rows.rows, collator


def assert_pieces_match(model, examples, batch, pieces, padding_free, shift, reference=None):
    packed = tiny.packed_token_losses(model, batch, pieces, examples, shift, padding_free)
    by_piece = (
        dict(zip([p for row in pieces for p in row], tiny.padded_token_losses(model, reference, shift)))
        if reference is not None
        else None
    )
    alone = tiny.padded_token_losses(model, examples, shift)
    assert len(packed) == sum(len(row) for row in pieces)
    for piece, losses in packed:
        expected = by_piece[piece] if by_piece is not None else alone[piece.example]
        torch.testing.assert_close(losses, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", tiny.MODELS)
def test_packed_per_token_loss_and_model_loss_equal_the_padded_ones(name, impl, padding_free):
    model = tiny.model(name, impl)
    examples = tiny.examples(name)
    batch, pieces, _ = pack(model, examples, padding_free=padding_free)
    assert len(pieces) < len(examples)  # rows hold several examples, or this compares nothing
    assert batch["input_ids"].shape[0] == (1 if padding_free else len(pieces))
    shift = tiny.shifts(model)
    with torch.no_grad():
        assert_pieces_match(model, examples, batch, pieces, padding_free, shift)
        padded = tiny.padded_batch(examples)
        # num_items_in_batch counts the real targets: labels after each example's first token for causal LMs
        items = sum(sum(label != -100 for label in e["labels"][1 if shift else 0 :]) for e in examples)
        assert int(item_counter(model, ["labels"])(batch)) == items
        loss = model(**batch, num_items_in_batch=items).loss
        torch.testing.assert_close(loss, model(**padded, num_items_in_batch=items).loss, atol=1e-5, rtol=0)


def test_causal_labels_are_ignored_at_each_examples_first_token_and_nowhere_else():
    model = tiny.model("llama")
    examples = tiny.examples("llama")
    batch, pieces, _ = pack(model, examples, padding_free=True)
    starts = batch["position_ids"][0] == 0
    assert (batch["labels"][0][starts] == -100).all()
    expected = torch.cat(
        [torch.tensor(examples[p.example]["labels"][p.start + 1 : p.end]) for row in pieces for p in row]
    )
    assert torch.equal(batch["labels"][0][~starts], expected)


def test_unshifted_labels_keep_each_examples_first_token():
    model = tiny.model("bert")
    examples = tiny.examples("bert")
    batch, pieces, _ = pack(model, examples, padding_free=True)
    expected = torch.cat([torch.tensor(examples[p.example]["labels"]) for row in pieces for p in row])
    assert torch.equal(batch["labels"][0], expected)
    assert (batch["labels"][0][batch["position_ids"][0] == 0] != -100).all()  # the examples' first tokens are targets


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_block_mask_is_what_keeps_examples_apart(name):
    """Without kiln's mask (its hook removed) the same packed batch scores differently: the comparisons above
    can fail. And with it, changing one example's tokens changes nothing in the others of its row."""
    model = tiny.model(name)
    examples = tiny.examples(name)
    batch, pieces, _ = pack(model, examples, padding_free=True)
    shift = tiny.shifts(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        masked = model(**inputs).logits
        first = pieces[0][0]
        changed = dict(inputs, input_ids=inputs["input_ids"].clone())
        changed["input_ids"][0, : first.length] = (changed["input_ids"][0, : first.length] + 1) % tiny.VOCAB
        torch.testing.assert_close(
            model(**changed).logits[0, first.length :], masked[0, first.length :], atol=1e-6, rtol=0
        )
        model._kiln_packing_hook.remove()
        with pytest.raises(AssertionError):
            assert_pieces_match(model, examples, batch, pieces, True, shift)


@pytest.mark.parametrize("strategy", ["wrapped", "bfd_split"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_split_examples_are_scored_as_pieces_of_their_own(name, strategy):
    model = tiny.model(name)
    examples = tiny.examples(name)
    batch, pieces, _ = pack(model, examples, strategy=strategy, max_length=8)
    assert any(p.start > 0 for row in pieces for p in row)  # some example continues in another row
    assert all(sum(p.length for p in row) <= 8 for row in pieces)
    every = [p for row in pieces for p in row]
    with torch.no_grad():
        assert_pieces_match(
            model, examples, batch, pieces, False, tiny.shifts(model), reference=tiny.as_examples(examples, every)
        )


def test_bfd_cuts_examples_longer_than_a_row_to_their_first_tokens(caplog):
    model = tiny.model("qwen2")
    examples = tiny.examples("qwen2")
    with caplog.at_level("WARNING"):
        batch, pieces, _ = pack(model, examples, max_length=8)
    long = sum(len(e["input_ids"]) > 8 for e in examples)
    assert long and f"cut {long} example(s) longer than max_length=8" in caplog.text
    assert "so far" not in caplog.text  # the whole dataset was planned: the count is final
    assert all(p.start == 0 and p.end == min(8, len(examples[p.example]["input_ids"])) for row in pieces for p in row)
    assert sorted(p.example for row in pieces for p in row) == list(range(len(examples)))
    cut = [{k: list(v)[:8] for k, v in e.items()} for e in examples]
    with torch.no_grad():
        assert_pieces_match(model, cut, batch, pieces, False, True)


@pytest.mark.parametrize(
    "name",
    # heavy: Transformers compiles flex_attention and its block mask, ~40 s of inductor's C++ build per model on a
    # machine without its cache; BERT's bidirectional mask is checked through SDPA and eager attention above
    ["llama", pytest.param("bert", marks=pytest.mark.heavy)],
)
def test_flex_attention_forward_gets_a_block_mask(name):
    """flex_attention has no backward on CPU: its forward is compared."""
    model = tiny.model(name, "flex_attention")
    examples = tiny.examples(name, n=6)
    batch, pieces, _ = pack(model, examples, padding_free=False)
    with torch.no_grad():
        assert_pieces_match(model, examples, batch, pieces, False, tiny.shifts(model))


def varlen_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """flash-attention's varlen contract on CPU: attention within each [cu[i], cu[i+1]) of the batch's tokens
    taken row after row (query: batch, heads, length, dim), causal per the module."""
    assert attention_mask is None and "cu_seq_lens_q" in kwargs, "the varlen arguments did not reach attention"
    cu = kwargs["cu_seq_lens_q"].tolist()
    b, h, n, d = query.shape
    q, k, v = (t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (query, key, value))
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    out = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1),
                k[s:e].transpose(0, 1),
                v[s:e].transpose(0, 1),
                scale=scaling,
                is_causal=module.is_causal,
            ).transpose(0, 1)
            for s, e in zip(cu[:-1], cu[1:])
        ]
    )
    return out.view(b, n, h, d), None


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_flash_attention_implementations_get_the_varlen_arguments(name, padding_free, monkeypatch):
    from transformers.modeling_utils import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_kiln_reference", varlen_reference)
    model = tiny.model(name)
    model.config._attn_implementation = "flash_kiln_reference"  # "flash" in the name: transformers' flash test
    examples = tiny.examples(name)
    batch, pieces, _ = pack(model, examples, padding_free=padding_free)
    assert isinstance(batch["max_length_q"], int) and batch["cu_seq_lens_q"].dtype == torch.int32
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        alone = tiny.padded_token_losses(model, examples, tiny.shifts(model))
        model.config._attn_implementation = "flash_kiln_reference"
        for piece, losses in tiny.packed_token_losses(model, batch, pieces, examples, tiny.shifts(model), padding_free):
            torch.testing.assert_close(losses, alone[piece.example], atol=1e-5, rtol=0)


def test_padding_free_is_on_by_default_for_flash_attention_only(monkeypatch):
    from transformers.modeling_utils import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_kiln_reference", varlen_reference)
    model = tiny.model("llama")
    examples = tiny.examples("llama")
    assert pack(model, examples)[0]["input_ids"].shape[0] > 1
    model.config._attn_implementation = "flash_kiln_reference"
    assert pack(model, examples)[0]["input_ids"].shape[0] == 1
