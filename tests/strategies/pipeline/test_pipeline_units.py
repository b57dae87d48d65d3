"""The pipeline axis's parts, in one process: which decoder layers each stage holds (`stage_layers`,
`keep_stage`), that two pruned copies of a model chained stage to stage compute the full model's
logits, that padding a window to one shape leaves each micro-batch's loss and gradients as they were,
and the refusals at config load, one sentence each."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from kiln.strategies.mesh.dims import ParallelDims, parse_mesh
from kiln.strategies.mesh.pipeline import stack_window
from kiln.strategies.mesh.pipeline_settings import PipelineSettings, check_pipeline, read_pipeline
from kiln.strategies.mesh.pipeline_split import StageForward, auto_costs, decoder_of, keep_stage, stage_layers
from kiln.strategies.mesh.settings import MeshSettings
from kiln.utils.errors import ConfigError, KilnError
from tests.strategies.pipeline.cases import VOCAB, llama

FP32 = SimpleNamespace(forward_context=lambda: torch.autocast("cpu", enabled=False))


def test_auto_split_balances_parameters_then_layer_count():
    assert stage_layers([10] * 4, 2, None) == [range(0, 2), range(2, 4)]
    assert stage_layers([10] * 5, 2, None) == [range(0, 2), range(2, 5)]  # ties: the earliest cut
    # heavy embeddings on stage 0 push layers to the later stages
    assert stage_layers([10] * 6, 3, None, first=25) == [range(0, 1), range(1, 3), range(3, 6)]
    assert stage_layers([10] * 6, 2, None, last=20) == [range(0, 4), range(4, 6)]
    assert stage_layers([1, 1, 10, 1], 2, None) == [range(0, 2), range(2, 4)]
    assert stage_layers([10] * 4, 2, [1]) == [range(0, 1), range(1, 4)]  # the user's cut wins
    assert stage_layers([10] * 4, 4, None) == [range(i, i + 1) for i in range(4)]


@pytest.mark.parametrize(
    ("split", "stages", "match"),
    [
        ([0], 2, r"split is \[0\]; give 1 increasing layer index\(es\) between 1 and 3"),
        ([4], 2, "between 1 and 3"),
        ([2, 1], 3, "increasing"),
        ([1, 1], 3, "increasing"),
        ([1, 2], 2, "give 1 increasing"),
        (["1"], 2, "give 1 increasing"),
    ],
)
def test_a_bad_split_is_one_sentence(split, stages, match):
    with pytest.raises(ConfigError, match=match):
        stage_layers([10] * 4, stages, split)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="the model has 4 decoder layer"):
        stage_layers([10] * 4, 5, None)


def test_each_stage_keeps_its_layers_under_the_full_models_names_and_chained_they_compute_its_logits():
    full = llama()
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    want = full(input_ids=ids, attention_mask=mask).logits
    stages = []
    for index, layers in enumerate(stage_layers([1] * 4, 2, None)):
        model = llama()
        decoder = decoder_of(model)
        keep_stage(model, decoder, layers, first=index == 0, last=index == 1)
        stages.append(StageForward(model, decoder, FP32, first=index == 0, last=index == 1))
    first, last = (sorted(stage.model.state_dict()) for stage in stages)
    assert "model.embed_tokens.weight" in first and "model.layers.1.mlp.up_proj.weight" in first
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.", "model.norm", "lm_head")) for k in first)
    assert "model.layers.2.self_attn.q_proj.weight" in last and "lm_head.weight" in last and "model.norm.weight" in last
    assert not any(k.startswith(("model.layers.0.", "model.layers.1.", "model.embed")) for k in last)
    assert sorted(first + last) == sorted(full.state_dict())
    got = stages[1](stages[0](ids, attention_mask=mask), attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_auto_costs_count_embeddings_first_and_norm_and_head_last():
    model = llama()
    costs, first, last = auto_costs(model, decoder_of(model))
    assert len(costs) == 4 and first == VOCAB * 32 and last == 32 + 32 * VOCAB


def test_padding_a_window_to_one_shape_keeps_each_micro_batchs_loss_and_gradients():
    g = torch.Generator().manual_seed(1)
    window = [
        {"input_ids": torch.randint(0, VOCAB, (3, 6), generator=g)},
        {
            "input_ids": torch.randint(0, VOCAB, (2, 9), generator=g),
            "attention_mask": torch.ones(2, 9, dtype=torch.long),
        },
    ]
    window[1]["attention_mask"][0, 7:] = 0
    for b in window:
        b["labels"] = b["input_ids"].roll(-1, 1)
    ids, mask, labels = stack_window(window)
    assert ids.shape == (6, 9) and mask is not None and mask.shape == (6, 9) and len(labels) == 2
    assert bool((labels[1][2:] == -100).all()) and bool((labels[0][:, 6:] == -100).all())
    assert bool((mask[0:3, 6:] == 0).all()) and bool((mask[3, 7:] == 0).all()) and bool((mask[4] == 1).all())
    assert bool((mask[5] == 1).all())  # a row added for the shape attends normally
    for i, b in enumerate(window):
        model = llama()
        want = model(**b).loss
        want.backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        rows = slice(3 * i, 3 * i + 3)
        logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits
        got = model.loss_function(logits=logits, labels=labels[i], vocab_size=VOCAB)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for p, w in zip(model.parameters(), want_grads):
            torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def test_a_batch_a_stage_cannot_read_is_one_sentence():
    with pytest.raises(KilnError, match="dict batches with input_ids and labels"):
        stack_window([(torch.zeros(2, 3),)])
    with pytest.raises(
        KilnError, match="reads only input_ids, labels, attention_mask of a batch, and it holds token_type_ids"
    ):
        stack_window(
            [{"input_ids": torch.zeros(1, 2), "labels": torch.zeros(1, 2), "token_type_ids": torch.zeros(1, 2)}]
        )


def test_a_model_kiln_cannot_split_is_one_sentence():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(
        ConfigError, match="cannot split GPT2LMHeadModel: kiln splits Transformers decoders shaped as Llama"
    ):
        decoder_of(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32)))
    tied = llama()
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="shares its weight with the embeddings"):
        decoder_of(tied)
    mixed = llama()
    mixed.config.layer_types = ["full_attention", "sliding_attention"] * 2
    with pytest.raises(ConfigError, match="mix attention types"):
        decoder_of(mixed)


def test_the_pipeline_settings_are_read_once_with_one_sentence_per_mistake():
    assert read_pipeline(None) == PipelineSettings("1f1b", None, None)
    assert read_pipeline({"schedule": "GPipe", "microbatches": 4, "split": [2]}) == PipelineSettings("gpipe", 4, (2,))
    given = OmegaConf.create({"microbatches": 1, "split": [1, 3]})  # as the config holds it
    assert read_pipeline(given) == PipelineSettings("1f1b", 1, (1, 3))
    for bad, match in [
        ({"schedule": "zbv"}, "schedule is 'zbv'; choose one of gpipe, 1f1b"),
        ({"microbatches": 0}, "microbatches is 0; give a positive"),
        ({"split": "even"}, "split is 'even'; give auto or a list"),
        ({"split": 2}, "split is 2; give auto or a list"),
        ({"microbatches": -1}, "microbatches is -1; give a positive"),
        ({"stages": 2}, "unknown key"),
        ("1f1b", "give a mapping"),
    ]:
        with pytest.raises(ConfigError, match=match):
            read_pipeline(bad)


def _config(**train):
    base = {
        "gradient_accumulation_steps": 2,
        "torch_compile": False,
        "torch_compile_backend": None,
        "torch_compile_mode": None,
        "gradient_checkpointing": False,
        "label_smoothing_factor": 0.0,
        "neftune_noise_alpha": None,
    }
    return OmegaConf.create({"train": {**base, **train}, "eval": {"strategy": "no"}})


def test_what_the_pipeline_cannot_run_yet_is_refused_at_config_load():
    pp2, ok = ParallelDims(pp=2), PipelineSettings()
    check_pipeline(ok, pp2, MeshSettings(), _config(), "bf16")  # what runs passes
    with pytest.raises(ConfigError, match=r"combines pp 2 with dp_shard 2, .*not supported yet"):
        check_pipeline(ok, ParallelDims(pp=2, dp_shard=2), MeshSettings(), _config(), "fp32")
    with pytest.raises(ConfigError, match=r"does not run with offload, train.torch_compile yet; drop them"):
        check_pipeline(ok, pp2, MeshSettings(offload=True), _config(torch_compile=True), "fp32")
    with pytest.raises(ConfigError, match=r"precision fp16"):
        check_pipeline(ok, pp2, MeshSettings(), _config(), "fp16")
    with pytest.raises(ConfigError, match=r"eval.strategy"):
        check_pipeline(ok, pp2, MeshSettings(), OmegaConf.merge(_config(), {"eval": {"strategy": "steps"}}), "fp32")
    with pytest.raises(
        ConfigError, match=r"microbatches is 4, but .* window's \(2\); set train.gradient_accumulation_steps to 4"
    ):
        check_pipeline(PipelineSettings(microbatches=4), pp2, MeshSettings(), _config(), "fp32")
    with pytest.raises(ConfigError, match=r"1f1b needs at least as many micro-batches as stages"):
        check_pipeline(ok, ParallelDims(pp=4), MeshSettings(), _config(), "fp32")
    check_pipeline(PipelineSettings("gpipe"), ParallelDims(pp=4), MeshSettings(), _config(), "fp32")


def test_pp_is_the_outermost_axis_and_must_divide_the_world():
    dims = parse_mesh({"pp": 2}, 2)
    assert dims.pp == 2 and dims.stage_ranks == 1 and [dims.stage(r) for r in range(2)] == [0, 1]
    assert dims.data_rank(1) == 0 and not dims.fsdp and dims.describe() == "pp 2"
    four = parse_mesh({"pp": 2, "dp_shard": -1}, 4)
    assert [four.stage(r) for r in range(4)] == [0, 0, 1, 1] and [four.data_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert four.mesh_axes() == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 1, 2, 1, 1))
    with pytest.raises(ConfigError, match="multiplies to 2 processes but this run has 3"):
        parse_mesh({"pp": 2}, 3)
    with pytest.raises(ConfigError, match="fixed axes multiply to 2, which does not divide the world size 3"):
        parse_mesh({"pp": 2, "dp_shard": -1}, 3)


def test_model_parallel_picks_the_pipeline_for_a_pp_axis_and_refuses_a_pipeline_without_one():
    from kiln.strategies.model_parallel.strategy import ModelParallelPipeline, ModelParallelStrategy

    def cfg(options):
        return OmegaConf.create({"strategy": {"name": "model_parallel", "options": options}})

    assert ModelParallelStrategy.resolve(cfg({"mesh": {"pp": 2}})) is ModelParallelPipeline
    assert ModelParallelStrategy.resolve(cfg({"mesh": {"tp": 2}})) is ModelParallelStrategy
    with pytest.raises(ConfigError, match="strategy.pipeline is set, but strategy.mesh has no pp axis"):
        ModelParallelStrategy.resolve(cfg({"pipeline": {"schedule": "gpipe"}}))
