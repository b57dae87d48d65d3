"""model_parallel's checks that need no process group: the mesh (axes, -1, product vs world size, cp
with tp refused), HF's parallelism_config, the tensor-parallel plan (auto from the Llama config, patterns,
styles, heads and split sizes, tied weights), and the refusals the Trainer's constructor makes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.config import load_config
from kiln.strategies.mesh.dims import ParallelDims, parse_mesh
from kiln.strategies.mesh.tp_plan import check_plan, resolve_plan
from kiln.utils.errors import CapabilityError, ConfigError
from tests.strategies.model_parallel.cases import llama

# -- the mesh ------------------------------------------------------------------------------------


def test_missing_axes_are_one_and_minus_one_takes_the_rest():
    assert parse_mesh({"dp_shard": 2, "tp": 2}, 4) == ParallelDims(dp_shard=2, tp=2)
    shape = parse_mesh({"dp_replicate": 2, "dp_shard": -1, "tp": 2}, 12)
    assert shape == ParallelDims(dp_replicate=2, dp_shard=3, tp=2)
    assert (shape.dp, shape.model_ranks) == (6, 2)
    assert [shape.data_rank(r) for r in range(12)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # a TP pair shares data
    assert parse_mesh(None, 3) == ParallelDims(dp_shard=3)  # default: FSDP over every process
    shape = parse_mesh({"dp_shard": -1, "cp": 2, "tp": 2}, 8)  # cp x tp: one data shard is a cp x tp block
    assert shape == ParallelDims(dp_shard=2, cp=2, tp=2) and (shape.dp, shape.dp_cp, shape.model_ranks) == (2, 4, 4)
    assert [shape.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert parse_mesh({"tp": 2}, 2) == ParallelDims(tp=2)  # an axis ParallelDims is not given is 1 too


def test_a_mesh_describes_itself_by_the_axes_it_uses():
    assert parse_mesh({"dp_shard": 2, "tp": 2}, 4).describe() == "dp_shard 2 x tp 2"
    assert parse_mesh({"dp_shard": 1}, 1).describe() == "one process"


@pytest.mark.parametrize(
    "mesh, world, words",
    [
        ({"dp_shard": 2, "tp": 2}, 6, "multiplies to 4 processes but this run has 6"),
        ({"dp_shard": -1, "tp": 4}, 6, "does not divide the world size 6"),
        ({"dp_shard": -1, "tp": -1}, 4, "only one axis may take the rest"),
        ({"tp": 0}, 1, "strategy.mesh.tp is 0"),
        ({"pp": 2}, 3, "multiplies to 2 processes but this run has 3"),
        ({"ep": 2, "cp": 2}, 4, r"combines ep 2 with cp 2, but kiln runs the expert axis alone, within dp_shard"),
        ({"dp": 2}, 2, "unknown axis 'dp'"),
    ],
)
def test_a_wrong_mesh_is_one_sentence(mesh, world, words):
    with pytest.raises(ConfigError, match=words) as err:
        parse_mesh(mesh, world)
    assert str(err.value).count(". ") == 0  # one sentence


def test_hf_parallelism_config_selects_model_parallel_with_its_mesh():
    from accelerate.parallelism_config import ParallelismConfig

    for value in ({"dp_shard_size": 2, "tp_size": 2}, ParallelismConfig(dp_shard_size=2, tp_size=2)):
        cfg = load_config({"parallelism_config": value})
        assert cfg.strategy.name == "model_parallel"
        assert parse_mesh(cfg.strategy.options.mesh, 4) == ParallelDims(dp_shard=2, tp=2)
    with pytest.raises(ValueError, match="sp_size"):
        load_config({"parallelism_config": {"tp_size": 2, "sp_size": 2}})


# -- the Trainer refuses before any process group starts ------------------------------------------


def _trainer(tmp_path, **cfg):
    from kiln import Trainer

    base = {"output_dir": str(tmp_path), "save": {"strategy": "no"}, "log": {"disable_tqdm": True}}
    return Trainer(llama(), {**base, **cfg}, train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}])


@pytest.mark.parametrize(
    "cfg, error, words",
    [
        (
            {"strategy": {"name": "model_parallel", "device": "cpu", "mesh": {"tp": 2}}},
            ConfigError,
            r"strategy.mesh \(tp: 2\) multiplies to 2 processes but this run has 1",
        ),
        (
            {"parallelism_config": {"dp_shard_size": 2, "tp_size": 2}, "strategy": {"device": "cpu"}},
            ConfigError,
            "multiplies to 4 processes but this run has 1",
        ),
        (
            {"strategy": {"name": "model_parallel", "device": "cpu", "mesh": {"cp": 1, "tp": 1}}, "precision": "apex"},
            CapabilityError,
            "cannot train with precision 'apex': apex's amp cannot handle",
        ),
        (
            {"strategy": {"name": "model_parallel", "device": "cpu", "mesh": {"tp": 1}, "tp_pln": "auto"}},
            ConfigError,
            "Did you mean 'tp_plan'",
        ),
    ],
)
def test_the_trainer_refuses_in_its_constructor(tmp_path, cfg, error, words):
    import torch.distributed as dist

    with pytest.raises(error, match=words):
        _trainer(tmp_path, **cfg)
    assert not dist.is_initialized()


# -- the tensor-parallel plan ----------------------------------------------------------------------


def test_auto_is_the_llama_plan_with_its_prefixes():
    plan = resolve_plan(llama(), "auto")
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    assert len(plan) == 2 * 7 + 2
    assert check_plan(llama(), plan, 2) == plan


def test_a_mapping_matches_patterns_and_replicate_leaves_a_layer_whole():
    plan = resolve_plan(
        llama(),
        {
            "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.0.mlp.down_proj": "replicate",
            "model.layers.*.mlp.down_proj": "rowwise",
        },
    )
    assert plan == {
        "model.layers.0.mlp.up_proj": "colwise",
        "model.layers.1.mlp.up_proj": "colwise",
        "model.layers.1.mlp.down_proj": "rowwise",
    }


@pytest.mark.parametrize(
    "plan, words",
    [
        (
            {"model.layers.*.mlp.up_prj": "colwise"},
            "names 'model.layers.*.mlp.up_prj', which matches no module of LlamaForCausalLM",
        ),
        ({"model.layers.*.mlp.up_proj": "diagonal"}, "unknown style 'diagonal'"),
        ({"model.norm": "sequence_parallel"}, "style 'sequence_parallel', which kiln does not take in a mapping"),
        ("everything", "strategy.tp_plan is 'everything'"),
    ],
)
def test_a_wrong_plan_is_one_sentence(plan, words):
    with pytest.raises(ConfigError, match=words):
        resolve_plan(llama(), plan)


@pytest.mark.parametrize(
    "plan, tp, words",
    [
        ("auto", 8, "tp 8 does not divide the model's 4 attention heads"),
        ("auto", 4, "tp 4 does not divide the model's 2 key/value heads"),
        (
            {"model.norm": "colwise"},
            2,
            r"gives model.norm \(LlamaRMSNorm\) the style 'colwise', which applies to Linear",
        ),
    ],
)
def test_the_tp_size_must_fit_the_model(plan, tp, words):
    model = llama()
    with pytest.raises(ConfigError, match=words):
        check_plan(model, resolve_plan(model, plan), tp)


def test_a_split_size_the_tp_size_does_not_divide_is_refused():
    net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    with pytest.raises(ConfigError, match=r"tp 4 does not divide the 6 output features of 0 \(Linear\)"):
        check_plan(net, resolve_plan(net, {"0": "colwise", "1": "rowwise"}), 4)
    assert check_plan(net, resolve_plan(net, {"0": "colwise", "1": "rowwise"}), 2) == {"0": "colwise", "1": "rowwise"}


def test_tied_embeddings_stay_replicated():
    from transformers import LlamaForCausalLM

    from tests.strategies.model_parallel.cases import llama_config

    config = llama_config()
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = check_plan(model, resolve_plan(model, "auto"), 2)
    assert "lm_head" not in plan and "model.embed_tokens" not in plan and "model.layers.0.self_attn.q_proj" in plan


def test_configure_model_and_a_tp_plan_together_are_refused():
    """Both would parallelise the model; the refusal comes before the mesh is used (so no group is needed)."""
    from kiln.precision import build_precision
    from kiln.strategies.model_parallel.strategy import ModelParallelStrategy
    from tests.strategies.model_parallel.cases import HookedLlama

    cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu", "mesh": {"tp": 1}, "tp_plan": "auto"}})
    strategy = ModelParallelStrategy(cfg, build_precision(cfg))
    strategy.device_mesh = object()  # stands in for the mesh: setup_module must refuse before using it
    with pytest.raises(ConfigError, match="defines configure_model.*and strategy.tp_plan is set too; drop one of them"):
        strategy.setup_module(HookedLlama())
