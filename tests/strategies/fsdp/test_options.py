"""The three ways to ask for FSDP (kiln keys, HF `fsdp`/`fsdp_config`, accelerate's FSDP settings)
resolve to the same settings; settings FSDP2 lacks are logged once as having no effect; bad input
is one sentence. These need no process group."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kiln.config.load import load_config
from kiln.launch.settings import accelerate_settings
from kiln.strategies.capabilities import check_compatible
from kiln.strategies.fsdp.options import FSDPSettings
from kiln.strategies.fsdp.strategy import FSDPStrategy
from kiln.strategies.wrap_policy import blocks_to_wrap
from kiln.utils.errors import CapabilityError, ConfigError
from tests.strategies.fsdp.cases import TinyLM


def _settings(cfg: dict) -> FSDPSettings:
    from kiln.precision.fp32 import FP32Precision

    return FSDPStrategy(
        load_config({**cfg, "strategy": {**cfg.get("strategy", {}), "device": "cpu"}}), FP32Precision()
    ).settings


NATIVE = {
    "strategy": {
        "name": "fsdp",
        "sharding": "shard_grad_op",
        "wrap": ["Block"],
        "offload": True,
        "state_dict_type": "full",
        "activation_checkpointing": True,
    }
}


def test_hf_flags_and_fsdp_config_mean_the_native_config(tmp_path):
    want = _settings(NATIVE)
    assert (want.sharding, want.wrap, want.offload, want.state_dict_type, want.reshard) == (
        "shard_grad_op",
        ["Block"],
        True,
        "full",
        False,
    )
    mapping = {
        "fsdp_transformer_layer_cls_to_wrap": ["Block"],
        "state_dict_type": "FULL_STATE_DICT",
        "fsdp_activation_checkpointing": True,
    }
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(mapping))
    for fsdp in ("shard_grad_op auto_wrap offload", ["shard_grad_op", "auto_wrap", "offload"]):
        for cfg in (mapping, str(path)):
            assert _settings({"fsdp": fsdp, "fsdp_config": cfg}) == want
    # the older top-level HF names
    assert _settings({"fsdp": "full_shard", "fsdp_min_num_params": 1000}).min_num_params == 1000
    assert _settings({"fsdp": "full_shard", "fsdp_transformer_layer_cls_to_wrap": "Block"}).wrap == ["Block"]


def test_accelerate_fsdp_settings_mean_the_native_config():
    """The HF guide's FSDP accelerate config, as `accelerate launch` exports it."""
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_SHARDING_STRATEGY": "2",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
        "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
        "FSDP_USE_ORIG_PARAMS": "true",
        "FSDP_SYNC_MODULE_STATES": "true",
        "FSDP_FORWARD_PREFETCH": "false",
    }
    (setting,) = [s for s in accelerate_settings(env) if s.key == "strategy.name"]
    values = setting.values
    got = _settings(
        {
            "strategy": {
                "name": "fsdp",
                "fsdp": values["strategy.options.fsdp"],
                "fsdp_config": values["strategy.options.fsdp_config"],
            }
        }
    )
    want = _settings(NATIVE)
    want.sync_module_states = True
    want.no_effect = {"use_orig_params": got.no_effect["use_orig_params"]}
    assert got == want


def test_settings_without_fsdp2_equivalent_are_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.strategies.fsdp.strategy"):
        s = _settings(
            {
                "fsdp": "full_shard",
                "fsdp_config": {
                    "use_orig_params": True,
                    "limit_all_gathers": True,
                    "backward_prefetch": "backward_post",
                },
            }
        )
    assert set(s.no_effect) == {"use_orig_params", "limit_all_gathers", "backward_prefetch"}
    lines = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(lines) == 3 and all(line.count(".") >= 1 for line in lines)


def test_native_keys_win_over_fsdp_config_and_the_conflict_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="kiln.strategies.fsdp.options"):
        s = _settings(
            {"strategy": {"name": "fsdp", "sharding": "no_shard", "fsdp_config": {"sharding_strategy": "FULL_SHARD"}}}
        )
    assert s.sharding == "no_shard"
    assert "FSDP setting sharding: strategy='no_shard' overrides fsdp_config='FULL_SHARD'." in [
        r.getMessage() for r in caplog.records
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln.strategies.fsdp.options"):  # the same value twice is no conflict
        _settings(
            {"strategy": {"name": "fsdp", "sharding": "full_shard", "fsdp_config": {"sharding_strategy": "full_shard"}}}
        )
    assert not any("overrides" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "given, no_effect",
    [
        ({"version": 2}, set()),
        ({"version": "2"}, set()),
        ({"version": 1}, {"version"}),  # kiln is FSDP2
        ({"use_orig_params": False}, set()),
        ({"use_orig_params": "true"}, {"use_orig_params"}),
        ({"limit_all_gathers": True, "backward_prefetch": "BACKWARD_PRE"}, {"limit_all_gathers"}),
    ],
)
def test_only_settings_asking_for_what_fsdp2_lacks_are_said_to_have_no_effect(given, no_effect):
    assert set(_settings({"fsdp": "full_shard", "fsdp_config": given}).no_effect) == no_effect


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"fsdp": "full_shard sideways"}, "fsdp flag 'sideways'"),
        ({"strategy": {"name": "fsdp", "sharding": "quarter"}}, "sharding 'quarter'"),
        ({"strategy": {"name": "fsdp", "state_dict_type": "local_png"}}, "state_dict_type"),
        (
            {"fsdp": "full_shard", "fsdp_config": "/nonexistent/fsdp.json"},
            "neither a mapping nor an existing JSON file",
        ),
        ({"fsdp": "full_shard", "fsdp_config": {"wrap_everything": True}}, "'wrap_everything'"),
        ({"strategy": {"name": "fsdp", "wrap": ["Block"], "min_num_params": 10}}, "set only one"),
    ],
)
def test_bad_settings_are_one_sentence(cfg, words):
    with pytest.raises(ConfigError) as err:
        _settings(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_wrap_class_not_found_lists_the_candidates():
    with pytest.raises(ConfigError) as err:
        blocks_to_wrap(TinyLM(), ["GPT2Block"], None)
    msg = str(err.value)
    assert "GPT2Block is not in the model" in msg and "classes are: Block, Embedding" in msg and "\n" not in msg


def test_wrap_default_is_no_split_modules_and_keeps_tied_modules_together():
    model = TinyLM()
    assert blocks_to_wrap(model, None, None) == [model.blocks[1], model.blocks[0]] or set(
        map(id, blocks_to_wrap(model, None, None))
    ) == {id(model.blocks[0]), id(model.blocks[1])}
    model.blocks[1].up.weight = model.blocks[0].up.weight  # a weight shared across two blocks
    assert blocks_to_wrap(model, None, None) == []  # both stay in the root unit: the tie survives


def test_hybrid_shard_with_a_world_the_mesh_cannot_factor_is_refused():
    from kiln.precision.fp32 import FP32Precision

    strategy = FSDPStrategy(
        load_config({"strategy": {"name": "fsdp", "device": "cpu", "sharding": "hybrid_shard"}}), FP32Precision()
    )
    strategy.settings.shard_size = 2  # built on this one process, which shard_size 2 could not divide either
    with pytest.raises(ConfigError, match=r"world size \(3\) to be a multiple of the shard group size \(2\)"):
        strategy.parallel_dims(3)


def test_fsdp_on_mps_is_refused_by_its_capabilities():
    with pytest.raises(CapabilityError, match="cannot run on 'mps'.*Use strategy: mps"):
        check_compatible("fsdp", FSDPStrategy.capabilities, precision="fp32", device=torch.device("mps"))


def test_apex_is_refused_by_its_capabilities():
    with pytest.raises(CapabilityError, match="apex's amp cannot handle FSDP"):
        check_compatible("fsdp", FSDPStrategy.capabilities, precision="apex", device=torch.device("cpu"))


def test_offload_with_pinned_memory_on_a_machine_without_an_accelerator_is_refused():
    from kiln.precision.fp32 import FP32Precision

    cfg = {"strategy": {"name": "fsdp", "device": "cpu", "offload": True, "offload_pin_memory": True}}
    with pytest.raises(ConfigError) as err:
        FSDPStrategy(load_config(cfg), FP32Precision())
    assert "needs an accelerator" in str(err.value) and "offload_pin_memory: false" in str(err.value)
    assert "\n" not in str(err.value)
    cfg["strategy"]["offload_pin_memory"] = False  # the fix named in the message
    assert FSDPStrategy(load_config(cfg), FP32Precision()).settings.offload_pin_memory is False


def test_cpu_ram_efficient_loading_is_a_setting_with_effect():
    s = _settings({"fsdp": "full_shard", "fsdp_config": {"fsdp_cpu_ram_efficient_loading": "true"}})
    assert s.cpu_ram_efficient_loading and "cpu_ram_efficient_loading" not in s.no_effect


@pytest.mark.parametrize(
    "flag, sharding", [("1", "full_shard"), ("2", "shard_grad_op"), ("SHARD_GRAD_OP", "shard_grad_op")]
)
def test_accelerate_command_line_flags_mean_the_native_config(flag, sharding):
    """`accelerate launch --use_fsdp --fsdp_sharding_strategy=N ...` as accelerate itself exports it
    (its CLI also always exports FSDP_RESHARD_AFTER_FORWARD=true, which FSDP1 configs do not use)."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = [
        "--use_fsdp",
        "--num_processes",
        "2",
        f"--fsdp_sharding_strategy={flag}",
        "--fsdp_auto_wrap_policy",
        "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap",
        "Block",
        "--fsdp_offload_params",
        "true",
        "--fsdp_state_dict_type",
        "FULL_STATE_DICT",
        "--fsdp_activation_checkpointing",
        "true",
        "train.py",
    ]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    (setting,) = [s for s in accelerate_settings(prepare_multi_gpu_env(args)) if s.key == "strategy.name"]
    got = _settings(
        {
            "strategy": {
                "name": "fsdp",
                "fsdp": setting.values["strategy.options.fsdp"],
                "fsdp_config": setting.values["strategy.options.fsdp_config"],
            }
        }
    )
    # accelerate's command-line defaults: --fsdp_sync_module_states and --fsdp_cpu_ram_efficient_loading true
    want = _settings(
        {
            "strategy": {
                **NATIVE["strategy"],
                "sharding": sharding,
                "sync_module_states": True,
                "cpu_ram_efficient_loading": True,
            }
        }
    )
    want.no_effect = got.no_effect  # use_orig_params and version 1, each logged as having no effect
    assert set(got.no_effect) == {"use_orig_params", "version"}
    assert got == want


def test_an_fsdp2_accelerate_config_uses_reshard_after_forward():
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}
    (setting,) = [s for s in accelerate_settings(env) if s.key == "strategy.name"]
    got = _settings(
        {
            "strategy": {
                "name": "fsdp",
                "fsdp": setting.values["strategy.options.fsdp"],
                "fsdp_config": setting.values["strategy.options.fsdp_config"],
            }
        }
    )
    assert (got.sharding, got.reshard) == ("full_shard", False)


def test_a_model_on_the_meta_device_is_refused_with_the_fix():
    from kiln.precision.fp32 import FP32Precision

    strategy = FSDPStrategy(load_config({"strategy": {"name": "fsdp", "device": "cpu"}}), FP32Precision())
    with torch.device("meta"):
        model = TinyLM()
    with pytest.raises(ConfigError, match="meta device; build it with real weights, or let the Trainer build it"):
        strategy.setup_module(model)
