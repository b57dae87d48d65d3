"""Which parameters get weight decay is HF's decision exactly (`Trainer.get_decay_parameter_names`),
on models whose bias-like parameters are not named `bias`: T5's `relative_attention_bias.weight`,
nn.MultiheadAttention's `in_proj_bias` / `bias_k` / `bias_v`, a `q_bias` as in BEiT/Data2Vec, and GPT-2.
HF decides from the full dotted name; a rule that looks only at the local name ("weight") decays
T5's relative position table, and one that tests `local == "bias"` decays `in_proj_bias`. Parity
tests cannot see this when both runs use the same (wrong) rule, so the names are compared to HF's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.optim.optimizers import decay_parameter_names, parameter_groups

transformers = pytest.importorskip("transformers")


def hf_decay_names(model: nn.Module) -> list[str]:
    """HF's decayed names in named_parameters() order, as its optimizer groups are built."""
    decayed = set(transformers.Trainer.get_decay_parameter_names(None, model))
    return [n for n, p in model.named_parameters() if n in decayed and p.requires_grad]


class Attention(nn.Module):
    """nn.MultiheadAttention with bias_k/bias_v, and a BEiT-style attention with q_bias/v_bias."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, add_bias_kv=True)
        self.qkv = nn.Linear(8, 24, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(8))
        self.v_bias = nn.Parameter(torch.zeros(8))
        self.out = nn.Linear(8, 8)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=32,
            d_model=8,
            d_kv=4,
            d_ff=16,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            relative_attention_num_buckets=4,
        )
    )


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2))


@pytest.mark.parametrize("build", [t5, gpt2, Attention], ids=["t5", "gpt2", "attention"])
def test_decayed_parameters_are_hfs(build):
    model = build()
    assert decay_parameter_names(model) == hf_decay_names(model)


def test_the_bias_like_parameters_are_not_decayed():
    """The names the local-name rule got wrong, spelled out (and HF agrees, by the test above)."""
    model = Attention()
    names = decay_parameter_names(model)
    for name in ("mha.in_proj_bias", "mha.bias_k", "mha.bias_v", "mha.out_proj.bias", "q_bias", "v_bias", "out.bias"):
        assert name not in names
    assert names == ["mha.in_proj_weight", "mha.out_proj.weight", "qkv.weight", "out.weight"]
    t5_names = decay_parameter_names(t5())
    assert not [n for n in t5_names if "relative_attention_bias" in n or "layer_norm" in n]
    assert "encoder.block.0.layer.0.SelfAttention.q.weight" in t5_names


def test_norm_names_and_a_parameter_inside_a_layernorm_follow_hf():
    """HF's name patterns (`norm`, `_norm`, `layernorm`, `rmsnorm`, but not `normal`/`norms`) and its
    LayerNorm rule at any depth (a parameter of a submodule inside a LayerNorm subclass)."""

    class Gated(nn.LayerNorm):
        def __init__(self, dim: int) -> None:
            super().__init__(dim)
            self.gate = nn.Linear(dim, dim, bias=False)

    model = nn.ModuleDict(
        {
            "norm": nn.Linear(2, 2, bias=False),
            "pre_norm": nn.Linear(2, 2, bias=False),
            "final_layernorm": nn.Linear(2, 2, bias=False),
            "q_rmsnorm": nn.Linear(2, 2, bias=False),
            "normal": nn.Linear(2, 2, bias=False),
            "norms": nn.Linear(2, 2, bias=False),
            "gated": Gated(2),
        }
    )
    assert decay_parameter_names(model) == hf_decay_names(model) == ["normal.weight", "norms.weight"]


def test_the_groups_hold_the_same_split():
    model = Attention()
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in decay["params"]] == hf_decay_names(model)
    assert {names[id(p)] for p in no_decay["params"]} == set(names.values()) - set(hf_decay_names(model))
