"""HF's FSDP dialect in kiln's words (kiln.config.hf.fsdp): the `fsdp` flags and `fsdp_config` become the
FSDP strategies' option names, in the order they apply."""

from __future__ import annotations

import pytest

from kiln.config.hf.fsdp import fsdp_options, xla_fsdp_options
from kiln.utils.errors import ConfigError


def test_the_flags_then_fsdp_config_in_kilns_names() -> None:
    got = fsdp_options(
        "hybrid_shard offload auto_wrap",
        {
            "fsdp_sharding_strategy": 1,
            "offload_params": False,
            "transformer_layer_cls_to_wrap": "Block, Head",
            "min_num_params": 7,
        },
    )
    assert got == [
        ("sharding", "hybrid_shard", "fsdp"),
        ("offload", True, "fsdp"),
        ("sharding", 1, "fsdp_config"),
        ("offload", False, "fsdp_config"),
        ("wrap", ["Block", "Head"], "fsdp_config"),
        ("min_num_params", 7, "fsdp_config"),
    ]
    assert fsdp_options(["no_shard"], None) == [("sharding", "no_shard", "fsdp")]
    assert fsdp_options(None, None) == fsdp_options(False, "") == []


def test_an_unknown_flag_or_an_unreadable_fsdp_config_is_one_sentence(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"fsdp flag 'ofload' is not one of full_shard, .*auto_wrap; fix the `fsdp`"):
        fsdp_options("full_shard ofload", None)
    with pytest.raises(ConfigError, match="neither a mapping nor an existing JSON file"):
        fsdp_options(None, str(tmp_path / "missing.json"))  # the CPU/CUDA strategy reads it strictly


def test_xla_reads_its_own_keys_and_says_which_have_no_effect(tmp_path) -> None:
    merged, no_effect = xla_fsdp_options(
        "full_shard shard_grad_op",
        {
            "xla": True,
            "xla_fsdp_v2": False,
            "xla_fsdp_settings": {"compute_dtype": "bfloat16"},
            "xla_fsdp_grad_ckpt": True,
            "transformer_layer_cls_to_wrap": ["Block"],
            "min_num_params": 3,
            "use_orig_params": True,
        },
    )
    assert merged == {
        "settings": {"reshard_after_forward": False, "compute_dtype": "bfloat16"},
        "wrapper": "classic",
        "activation_checkpointing": True,
        "wrap": ["Block"],
        "min_num_params": 3,
    }
    assert no_effect == {"use_orig_params": "it is a setting of the CPU/CUDA fsdp strategy"}
    assert xla_fsdp_options(None, {"xla_fsdp_v2": True})[0] == {"wrapper": "spmd"}
    # read leniently: what is not a mapping is left to the strategy's own checks
    assert xla_fsdp_options(None, str(tmp_path / "missing.json")) == ({}, {})
    with pytest.raises(ConfigError, match="fsdp flag 'offload' is not available with XLA FSDP"):
        xla_fsdp_options("offload", None)
    with pytest.raises(ConfigError, match="fsdp_config key 'mystery' is not an XLA FSDP setting"):
        xla_fsdp_options(None, {"mystery": 1})
