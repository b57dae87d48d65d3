"""The chunked causal-LM loss equals Transformers' own loss, and its gradients equal the plain loss's
within 1e-5, on the bare function (ignored tokens, a bias, num_items_in_batch, shift_labels, a ragged last
chunk) and on tiny Llama and GPT-2 models; what it cannot stand in for is refused in one sentence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.engine.model.chunked_loss import chunked_causal_lm_loss, chunked_cross_entropy
from kiln.utils.errors import ConfigError

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402


def grads_of(loss_fn, *leaves):  # type: ignore[no-untyped-def]
    for leaf in leaves:
        leaf.grad = None
    loss = loss_fn()
    loss.backward()
    return loss.detach(), [leaf.grad.clone() for leaf in leaves]


@pytest.mark.parametrize("chunk_size", [1, 7, 64])  # a chunk a token, a ragged last chunk, one chunk for all
@pytest.mark.parametrize("counted", [False, True])
def test_loss_and_gradients_equal_the_plain_loss(chunk_size, counted):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (3, 10), generator=g)
    labels[0, :4] = -100
    labels[2, 7:] = -100
    items = torch.tensor(21.0) if counted else None
    plain = grads_of(
        lambda: ForCausalLMLoss(nn.functional.linear(hidden, weight, bias), labels, 50, num_items_in_batch=items),
        hidden,
        weight,
        bias,
    )
    chunked = grads_of(
        lambda: chunked_cross_entropy(hidden, weight, bias, labels, chunk_size=chunk_size, num_items_in_batch=items),
        hidden,
        weight,
        bias,
    )
    torch.testing.assert_close(chunked[0], plain[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(chunked[1], plain[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_shift_labels_are_used_as_given():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 6, 8, generator=g), torch.randn(20, 8, generator=g)
    shifted = torch.randint(0, 20, (2, 6), generator=g)
    plain = ForCausalLMLoss(hidden @ weight.T, None, 20, shift_labels=shifted)
    chunked = chunked_cross_entropy(hidden, weight, None, None, chunk_size=5, shift_labels=shifted)  # type: ignore[arg-type]
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=1e-6)


def llama():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=97,
        )
    )


def gpt2():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32)
    )


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2-tied-head"])
def test_a_causal_lm_gets_its_own_loss_and_gradients(build):
    model = build().eval()  # no dropout: the two forwards must see the same activations
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (2, 12), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    params = [p for p in model.parameters() if p.requires_grad]
    items = torch.tensor(19)
    plain = grads_of(lambda: model(**batch, num_items_in_batch=items).loss, *params)
    chunked = grads_of(lambda: chunked_causal_lm_loss(model, batch, chunk_size=5, num_items_in_batch=items), *params)
    torch.testing.assert_close(chunked[0], plain[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(chunked[1], plain[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_what_it_cannot_stand_in_for_is_one_sentence():
    torch.manual_seed(0)
    gemma = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            num_hidden_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=32,
            vocab_size=40,
            final_logit_softcapping=30.0,
        )
    )
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(ConfigError, match=r"Gemma2ForCausalLM transforms its logits .*final_logit_softcapping=30.0"):
        chunked_causal_lm_loss(gemma, batch, chunk_size=4)
    with pytest.raises(ConfigError, match="Sequential has neither form"):
        chunked_causal_lm_loss(nn.Sequential(nn.Linear(2, 2)), batch, chunk_size=4)
    with pytest.raises(ConfigError, match="this batch has none"):
        chunked_causal_lm_loss(llama(), {"input_ids": batch["input_ids"]}, chunk_size=4)
    with pytest.raises(ConfigError, match="chunk_size is 0"):
        chunked_cross_entropy(
            torch.zeros(1, 2, 4), torch.zeros(3, 4), None, torch.zeros(1, 2, dtype=torch.long), chunk_size=0
        )
