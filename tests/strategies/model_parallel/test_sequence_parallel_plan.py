"""Sequence and loss parallelism decided without a process group: the sequence-sharded layout kiln
derives from the Llama plan (which layers, which norms), the models and plans it refuses (one
sentence each), where loss parallel falls back to the gathered head, and the option refusals the
Trainer's constructor and setup_module make. Their runs: test_sequence_loss_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.config import load_config
from kiln.strategies.mesh.loss_parallel import find_head
from kiln.strategies.mesh.sequence_parallel import derive_layout
from kiln.strategies.mesh.tp_plan import check_plan, hf_model, resolve_plan
from kiln.utils.errors import ConfigError
from tests.strategies.model_parallel.cases import llama, llama_config


def _plan(model: nn.Module, option="auto") -> dict[str, str]:
    return check_plan(model, resolve_plan(model, option), 2)


def _one_sentence(err: pytest.ExceptionInfo) -> None:
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_the_llama_layout_starts_at_the_embedding_and_ends_at_the_head():
    model = llama()
    layout = derive_layout(model, _plan(model))
    assert (layout.embedding, layout.head) == ("model.embed_tokens", "lm_head")
    assert layout.blocks == [f"model.layers.{i}.{b}" for i in (0, 1) for b in ("mlp", "self_attn")]
    assert layout.rowwise == [f"model.layers.{i}.{r}" for i in (0, 1) for r in ("mlp.down_proj", "self_attn.o_proj")]
    # every norm on the residual stream, the final one included; the rotary embedding (no parameters) is left alone
    assert sorted(layout.norms) == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]


def _tied() -> nn.Module:
    from transformers import LlamaForCausalLM

    config = llama_config()
    config.tie_word_embeddings = True
    return LlamaForCausalLM(config)


def _linear_between_blocks() -> nn.Module:
    model = llama()
    model.model.layers[0].post_attention_layernorm = nn.Linear(32, 32)
    return model


def _position_parameter() -> nn.Module:
    model = llama()
    model.model.register_parameter("positions", nn.Parameter(torch.zeros(8, 32)))
    return model


ENDS = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}


@pytest.mark.parametrize(
    "build, plan, words",
    [
        (
            _tied,
            "auto",
            r"splits 0 input embedding\(s\) \(embedding_rowwise\) and 0 output head\(s\).*tied input/output "
            "embeddings stay whole",
        ),
        (
            llama,
            {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"},
            "splits 0 input embedding",
        ),
        (
            llama,
            {**ENDS, "model.layers.*.mlp.up_proj": "colwise"},
            "the colwise layer model.layers.0.mlp.up_proj is not beside a rowwise layer",
        ),
        (llama, ENDS, "has no block of colwise layers ending in a rowwise layer"),
        (
            _linear_between_blocks,
            "auto",
            r"model.layers.0.post_attention_layernorm \(Linear\) sits on the residual stream",
        ),
        (_position_parameter, "auto", r"model \(LlamaModel\) has parameters of its own on the residual stream"),
    ],
    ids=["tied", "no_embedding", "colwise_alone", "no_block", "linear_between_blocks", "position_parameter"],
)
def test_a_layout_kiln_cannot_derive_is_one_sentence(build, plan, words):
    model = build()
    with pytest.raises(
        ConfigError,
        match=f"strategy.sequence_parallel cannot derive a sequence-sharded layout for LlamaForCausalLM: .*{words}",
    ) as err:
        derive_layout(model, _plan(model, plan))
    assert "set sequence_parallel: false (plain tensor parallel), or parallelise the model yourself" in str(err.value)
    _one_sentence(err)


def test_hf_sequence_parallel_style_in_a_mapping_points_to_the_switch():
    with pytest.raises(
        ConfigError,
        match="style 'sequence_parallel', which kiln does not take in a mapping: kiln "
        "derives sequence parallelism from the whole plan, so set "
        "strategy.sequence_parallel: true",
    ) as err:
        resolve_plan(llama(), {"model.norm": "sequence_parallel"})
    _one_sentence(err)


# -- loss parallel: where the head's logits can stay split ------------------------------------------


def _custom_loss(logits, labels, vocab_size, **kwargs):
    return logits.sum()


def test_loss_parallel_takes_the_causal_lm_head_and_falls_back_with_a_reason():
    model = llama()
    assert find_head(model, _plan(model), hf_model(model)[1]) == ("lm_head", "")
    tied = _tied()
    assert find_head(tied, _plan(tied), hf_model(tied)[1]) == (
        None,
        "tp_plan does not split the head lm_head colwise (tied input/output embeddings stay whole), so there are "
        "no split logits to keep",
    )
    model.loss_function = _custom_loss  # a loss kiln does not know runs on split logits
    assert find_head(model, _plan(model), hf_model(model)[1]) == (
        None,
        "LlamaForCausalLM's loss is '_custom_loss', not HF's ForCausalLMLoss, the loss kiln knows runs on "
        "vocab-split logits",
    )
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    assert find_head(net, {"0": "colwise", "1": "rowwise"}, None)[0] is None


# -- the options themselves ------------------------------------------------------------------------


def _trainer(tmp_path, **strategy):
    from kiln import Trainer

    cfg = {
        "output_dir": str(tmp_path),
        "save": {"strategy": "no"},
        "log": {"disable_tqdm": True},
        "strategy": {"name": "model_parallel", "device": "cpu", **strategy},
    }
    return Trainer(llama(), cfg, train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}])


@pytest.mark.parametrize(
    "strategy, words",
    [
        (
            {"mesh": {"tp": 1}, "sequence_parallel": True},
            r"strategy.sequence_parallel splits the activations of tensor "
            r"parallelism, and this mesh has no tp axis \(one process\); set mesh.tp",
        ),
        (
            {"loss_parallel": True},
            "strategy.loss_parallel splits the activations of tensor parallelism, and this mesh has no tp axis",
        ),
        ({"mesh": {"tp": 1}, "loss_parallel": "yes"}, "strategy.loss_parallel is 'yes'; give true or false"),
    ],
)
def test_the_trainer_refuses_the_options_without_a_tp_axis(tmp_path, strategy, words):
    import torch.distributed as dist

    with pytest.raises(ConfigError, match=words) as err:
        _trainer(tmp_path, **strategy)
    _one_sentence(err)
    assert not dist.is_initialized()


def test_configure_model_and_sequence_parallel_together_are_refused():
    from kiln.precision import build_precision
    from kiln.strategies.model_parallel.strategy import ModelParallelStrategy
    from tests.strategies.model_parallel.cases import HookedLlama

    cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu", "mesh": {"tp": 1}}})
    strategy = ModelParallelStrategy(cfg, build_precision(cfg))
    strategy.settings.sequence_parallel = True  # after the constructor, which would refuse it without a tp axis
    strategy.device_mesh = object()  # stands in for the mesh: setup_module must refuse before using it
    with pytest.raises(
        ConfigError,
        match=r"defines configure_model\(mesh\).*and strategy.sequence_parallel is set too; "
        "drop one of them",
    ) as err:
        strategy.setup_module(HookedLlama())
    _one_sentence(err)
