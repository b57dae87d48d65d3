"""Full and selective activation checkpointing of a tiny Llama's layers: the gradients are the
un-checkpointed run's exactly, and backward recomputes what each policy says it does (counted with a
dispatch mode): full recomputes the blocks' forward, selective recomputes no attention and half the
matmuls, `every: 2` half the blocks. Bad settings are one sentence each."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.strategies.activation_checkpointing import apply_activation_checkpointing, without_cache
from kiln.utils.errors import ConfigError

transformers = pytest.importorskip("transformers")

MM = "aten.mm.default"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def llama():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=50,
            attn_implementation="sdpa",
        )
    ).train()  # train mode: Transformers still builds a KV cache


def backward(**ac):  # type: ignore[no-untyped-def]
    """(gradients, the ops run in backward) of one step, checkpointed as `ac` says (nothing: no checkpointing)."""
    model = llama()
    if ac:
        apply_activation_checkpointing(model.model.layers, **ac)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    with Ops() as ops:
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), ops.counts


@pytest.fixture(scope="module")
def plain():  # type: ignore[no-untyped-def]
    return backward()


@pytest.mark.parametrize(
    "ac",
    [
        {"mode": "full"},
        {"mode": "full", "every": 2},
        {"mode": "selective"},
        {"mode": "selective", "every": 3},
        {"mode": "selective", "ops": ["aten.mm"]},
    ],
    ids=["full", "full-every-2", "selective", "selective-every-3", "selective-mm-only"],
)
def test_gradients_are_the_unchecked_runs(plain, ac):
    grads, _ = backward(**ac)
    torch.testing.assert_close(grads, plain[0], rtol=1e-6, atol=1e-7)


def test_each_policy_recomputes_what_it_says(plain):
    base = plain[1]
    full, half, selective = (
        backward(**ac)[1] for ac in ({"mode": "full"}, {"mode": "full", "every": 2}, {"mode": "selective"})
    )
    extra = {name: counts[MM] - base[MM] for name, counts in (("full", full), ("half", half), ("sel", selective))}
    assert extra["full"] > 0 and extra["full"] == 2 * extra["half"]  # every 2nd of 4 blocks: half the recompute
    # a block's 7 matmuls (q, k, v, o, gate, up, down): selective recomputes the 2nd, 4th and 6th; full recomputes
    # all but the last, whose output backward does not need (the recompute stops early)
    assert (extra["full"], extra["sel"]) == (4 * 6, 4 * 3)
    assert base[SDPA] == 0 and full[SDPA] == 4 and half[SDPA] == 2 and selective[SDPA] == 0  # attention is kept


def test_every_n_checkpoints_blocks_n_2n_and_leaves_the_forward_without_grad_alone():
    model = llama()
    layers = list(model.model.layers)
    chosen = apply_activation_checkpointing(model.model.layers, mode="full", every=2)
    assert chosen == [layers[1], layers[3]]
    assert "forward" in vars(layers[1]) and "forward" not in vars(layers[0])
    checkpointed = layers[1].forward
    assert apply_activation_checkpointing(model.model.layers, mode="full", every=2) == chosen  # a second set-up
    assert layers[1].forward is checkpointed  # is not checkpointed twice
    third = llama().model.layers
    assert apply_activation_checkpointing(third, mode="full", every=3) == [third[2]]  # blocks 3, 6, ...: the third
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        checkpointed = model(input_ids=ids).logits
    torch.testing.assert_close(checkpointed, llama()(input_ids=ids).logits)


@pytest.mark.parametrize(
    "ac, words",
    [
        ({"mode": "partial"}, "activation_checkpointing.mode is 'partial'; use full or selective"),
        ({"every": 0}, "activation_checkpointing.every is 0"),
        ({"mode": "full", "ops": ["aten.mm"]}, "set mode: selective or remove ops"),
        ({"mode": "selective", "ops": ["aten.not_an_op"]}, "names 'aten.not_an_op', which is not a torch operator"),
    ],
)
def test_a_bad_setting_is_one_sentence(ac, words):
    with pytest.raises(ConfigError) as err:
        apply_activation_checkpointing([torch.nn.Linear(2, 2)], **ac)
    assert words in str(err.value)


def test_a_checkpointed_block_never_gets_a_kv_cache():
    cache, other = object(), object()
    given = {"past_key_values": cache, "attention_mask": other}
    assert without_cache(given) == {"past_key_values": None, "attention_mask": other}
    assert given["past_key_values"] is cache  # the caller's dict is left alone
    assert without_cache({"layer_past": cache, "use_cache": True}) == {"layer_past": None, "use_cache": False}
    assert without_cache({"cache": cache}) == {"cache": None}
    plain = {"attention_mask": other, "use_cache": False}
    assert without_cache(plain) is plain  # nothing to drop: no new dict
