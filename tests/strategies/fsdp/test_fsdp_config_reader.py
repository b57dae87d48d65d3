"""One reader of HF's `fsdp_config` (kiln.config.hf.fsdp) for the fsdp strategy (strict), the
xla_fsdp routing and the XLA FSDP options (lenient), and one list of sharding strategies."""

from __future__ import annotations

import json

import pytest

from kiln.config.hf.fsdp import SHARDING, read_fsdp_config, sharding_name
from kiln.config.hf.xla import route_xla_fsdp
from kiln.strategies.fsdp.options import resolve as resolve_fsdp
from kiln.strategies.xla.fsdp_options import resolve as resolve_xla
from kiln.utils.errors import ConfigError


def _option(**given):
    return lambda key: given.get(key)


def test_a_file_and_a_mapping_read_the_same_with_prefixes_dropped(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_min_num_params": 7, "xla": True}))
    assert (
        read_fsdp_config(str(path), strict=True)
        == read_fsdp_config({"min_num_params": 7, "fsdp_xla": True}, strict=False)
        == {"min_num_params": 7, "xla": True}
    )


@pytest.mark.parametrize("value", ["no/such/file.json", 3, ["a"]])
def test_strict_refuses_what_lenient_leaves_to_the_strategy(value):
    assert read_fsdp_config(value, strict=False) == {}
    with pytest.raises(ConfigError, match="fsdp_config"):
        read_fsdp_config(value, strict=True)


def test_invalid_json_is_an_error_either_way(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{nope")
    for strict in (True, False):
        with pytest.raises(ConfigError, match="is not valid JSON"):
            read_fsdp_config(str(path), strict=strict)


def test_both_strategies_and_the_router_read_one_file_alike(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_transformer_layer_cls_to_wrap": ["Block"], "xla": True}))
    tree = {"strategy": {"name": "fsdp", "options": {"fsdp_config": str(path)}}}
    route_xla_fsdp(tree)
    assert tree["strategy"]["name"] == "xla_fsdp"
    assert resolve_xla(_option(fsdp_config=str(path))).wrap == ["Block"]
    assert resolve_fsdp(_option(fsdp_config={"transformer_layer_cls_to_wrap": ["Block"]})).wrap == ["Block"]


@pytest.mark.parametrize(
    "given, name",
    [(1, "full_shard"), ("2", "shard_grad_op"), ("5", "hybrid_shard_zero2"), ("NO_SHARD", "no_shard"), ("9", "9")],
)
def test_sharding_by_number_or_name(given, name):
    assert sharding_name(given) == name
    if name in SHARDING:
        assert resolve_fsdp(_option(sharding=given)).sharding == name
    else:
        with pytest.raises(ConfigError, match="is not one of full_shard"):
            resolve_fsdp(_option(sharding=given))
