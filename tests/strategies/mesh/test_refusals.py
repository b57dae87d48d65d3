"""What the mesh strategy cannot do on a mesh is refused under both presets in the same sentence,
before any process group starts (the constructor reads a 2-process launcher's topology); tp on a model
without a tensor-parallel plan (GPT-2) is one sentence naming the model families tp supports (issue 52
item 14), and every family it names has a plan in the installed transformers."""

from __future__ import annotations

import re

import pytest

from kiln.config import load_config
from kiln.precision.fp32 import FP32Precision
from kiln.strategies import STRATEGIES
from kiln.strategies.mesh.tp_plan import TP_FAMILIES
from kiln.utils.errors import ConfigError

#: the same mesh in each preset's words: tp 2 over both processes
TP2 = {"fsdp": {"tp": 2}, "model_parallel": {"mesh": {"tp": 2}}}


def _refusal(name: str, **options) -> str:
    import torch.distributed as dist

    config = load_config({"strategy": {"name": name, "device": "cpu", **options}})
    with pytest.raises(ConfigError) as err:
        STRATEGIES.get(name)(config, FP32Precision())
    assert not dist.is_initialized()
    message = str(err.value)
    assert "\n" not in message and message.count(". ") == 0, message  # one sentence
    return message


@pytest.fixture
def two_processes(monkeypatch):
    """The environment torchrun gives rank 0 of 2 (no group is started from it here)."""
    for key, value in {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(
    "options, words",
    [
        (
            {"offload": True},
            r"strategy.offload moves FSDP's shards to the CPU, and this mesh \(tp 2\) is tensor parallel "
            r"alone, with no FSDP to offload",
        ),
        (
            {"cpu_ram_efficient_loading": True},
            "strategy.cpu_ram_efficient_loading builds the model on rank 0 alone, which "
            "tensor parallelism cannot split from",
        ),
    ],
)
def test_what_tp_alone_cannot_do_is_refused_alike_under_both_presets(two_processes, options, words):
    fsdp, model_parallel = (_refusal(name, **TP2[name], **options) for name in ("fsdp", "model_parallel"))
    assert fsdp == model_parallel
    assert re.search(words, fsdp)


def test_the_chunked_loss_under_tp_is_refused_alike_under_both_presets(two_processes):
    refusals = []
    for name in ("fsdp", "model_parallel"):
        config = load_config(
            {"strategy": {"name": name, "device": "cpu", **TP2[name]}, "train": {"loss": {"chunked": True}}}
        )
        with pytest.raises(ConfigError) as err:
            STRATEGIES.get(name)(config, FP32Precision())
        refusals.append(str(err.value))
    assert refusals[0] == refusals[1] and refusals[0].count(". ") == 0
    assert re.match(
        r"train.loss.chunked multiplies .* tensor parallelism splits that head over this mesh's tp axis \(tp 2\)",
        refusals[0],
    )


@pytest.mark.parametrize(
    "options, words",
    [
        (
            {"sequence_parallel": True},
            r"strategy.sequence_parallel splits the activations of tensor parallelism, and this "
            r"mesh has no tp axis \(one process\); set mesh.tp \(fsdp: strategy.tp\) to 2 or more",
        ),
        ({"loss_parallel": True}, "strategy.loss_parallel splits the activations of tensor parallelism"),
        ({"offload": True, "offload_pin_memory": True}, "FSDP offload with pinned memory needs an accelerator"),
        ({"loss_parallel": "yes"}, "strategy.loss_parallel is 'yes'; give true or false"),
        ({"state_dict_type": "local_in_time"}, "state_dict_type 'local_in_time' is not sharded or full"),
        ({"wrap": ["Block"], "min_num_params": 10}, "wrap .* and min_num_params are both set"),
    ],
)
def test_what_a_setting_cannot_do_is_refused_alike_under_both_presets(options, words):
    fsdp, model_parallel = (_refusal(name, **options) for name in ("fsdp", "model_parallel"))
    assert fsdp == model_parallel
    assert re.search(words, fsdp)


def test_the_fsdp_preset_refuses_a_tp_that_does_not_divide_the_world(two_processes):
    assert (
        _refusal("fsdp", tp=3)
        == "strategy.tp is 3, which does not divide the world size (2); set tp to a divisor of 2."
    )


def test_both_presets_take_the_same_features():
    """compile, offload, activation checkpointing, fp16 and tp are capabilities and options of both."""
    fsdp, model_parallel = STRATEGIES.get("fsdp"), STRATEGIES.get("model_parallel")
    assert fsdp.capabilities == model_parallel.capabilities
    assert fsdp.capabilities.torch_compile and "fp16" in fsdp.capabilities.precisions
    for option in (
        "offload",
        "activation_checkpointing",
        "tp_plan",
        "sequence_parallel",
        "loss_parallel",
        "wrap",
        "state_dict_type",
        "cpu_ram_efficient_loading",
    ):
        assert option in fsdp.options and option in model_parallel.options
    assert fsdp.checkpoint_formats == model_parallel.checkpoint_formats == ("fsdp-sharded", "fsdp-full")


@pytest.mark.parametrize("name, sync", [("fsdp", False), ("model_parallel", True)])
def test_the_presets_defaults_differ_only_in_sync_module_states(name, sync):
    """model_parallel broadcasts rank 0's weights before sharding (each rank may have built its own), fsdp
    only when asked (HF's default); everything else is off until asked for, under both."""
    s = STRATEGIES.get(name)(load_config({"strategy": {"name": name, "device": "cpu"}}), FP32Precision()).settings
    got = {
        key: getattr(s, key)
        for key in (
            "wrap",
            "min_num_params",
            "offload",
            "offload_pin_memory",
            "activation_checkpointing",
            "forward_prefetch",
            "sync_module_states",
            "cpu_ram_efficient_loading",
            "state_dict_type",
            "tp_plan",
            "sequence_parallel",
            "loss_parallel",
            "reshard",
        )
    }
    assert got == {
        "wrap": None,
        "min_num_params": None,
        "offload": False,
        "offload_pin_memory": None,
        "activation_checkpointing": False,
        "forward_prefetch": False,
        "sync_module_states": sync,
        "cpu_ram_efficient_loading": False,
        "state_dict_type": "sharded",
        "tp_plan": None,
        "sequence_parallel": False,
        "loss_parallel": False,
        "reshard": True,
    }


# -- tp on a model without a plan (issue 52 item 14) -----------------------------------------------


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))


def test_tp_auto_on_gpt2_is_one_sentence_naming_the_families_tp_supports():
    from kiln import TrainingModule
    from kiln.strategies.mesh.tp_plan import resolve_plan

    class Wrapped(TrainingModule):  # a TrainingModule holding GPT-2 finds the same model
        def __init__(self):
            super().__init__()
            self.gpt = _gpt2()

    for model in (_gpt2(), Wrapped()):
        with pytest.raises(ConfigError) as err:
            resolve_plan(model, "auto")
        message = str(err.value)
        assert message.startswith("GPT2LMHeadModel has no tensor-parallel plan in transformers")
        assert "Conv1D layers (GPT-2's transposed linear layers) cannot be split colwise or rowwise" in message
        assert all(family in message for family in TP_FAMILIES) and "dp_shard" in message
        assert "\n" not in message and message.count(". ") == 0


def test_a_mapping_on_gpt2s_conv1d_layers_is_refused_too():
    from kiln.strategies.mesh.tp_plan import check_plan, resolve_plan

    model = _gpt2()
    with pytest.raises(
        ConfigError,
        match=r"gives transformer.h.0.mlp.c_fc \(Conv1D\) the style 'colwise', which applies "
        "to Linear layers only",
    ):
        check_plan(model, resolve_plan(model, {"transformer.h.*.mlp.c_fc": "colwise"}), 2)


@pytest.mark.parametrize("family", sorted(TP_FAMILIES))
def test_every_family_the_refusal_names_has_a_plan(family):
    from transformers import AutoConfig

    assert AutoConfig.for_model(TP_FAMILIES[family]).base_model_tp_plan, f"{family} has no tp plan in this transformers"


@pytest.mark.parametrize("axis", ["cp", "pp", "ep"])
def test_fp8_is_refused_on_each_axis_beyond_data_and_tp_and_runs_on_those(axis):
    """Straight on the checks (mesh/setting_checks.py), which both presets and the pp/ep subclasses share."""
    from kiln.strategies.mesh.dims import parse_mesh
    from kiln.strategies.mesh.setting_checks import check_settings
    from kiln.strategies.mesh.settings import MeshSettings

    config = load_config({})
    with pytest.raises(ConfigError, match=r"^precision fp8 runs on the data and tp axes only"):
        check_settings(MeshSettings(), parse_mesh({axis: 2}, 2), "cpu", "fp8", config)
    for mesh in ({"dp_shard": 2}, {"tp": 2}, {"dp_replicate": 2}):
        check_settings(MeshSettings(), parse_mesh(mesh, 2), "cpu", "fp8", config)
    check_settings(MeshSettings(), parse_mesh({axis: 2}, 2), "cpu", "bf16", config)
    chunked = load_config({"train": {"loss": {"chunked": True}}})
    check_settings(MeshSettings(), parse_mesh({"dp_shard": 2}, 2), "cpu", "fp32", chunked)  # no tp: nothing split
