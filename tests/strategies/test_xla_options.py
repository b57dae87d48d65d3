"""XLA FSDP settings as HF users write them (`fsdp` + `fsdp_config` with `xla: true`) and as kiln
keys, and the checks HF documents, as one-sentence errors. Pure configuration: runs without torch_xla."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kiln.config.load import load_config
from kiln.strategies.xla.fsdp_options import check_activation_checkpointing, resolve
from kiln.utils.errors import ConfigError


def _options(**given):
    return lambda key: given.get(key)


def test_fsdp_with_fsdp_config_xla_selects_xla_fsdp(tmp_path):
    cfg = load_config({"fsdp": "full_shard", "fsdp_config": {"xla": True, "xla_fsdp_grad_ckpt": True}})
    assert cfg.strategy.name == "xla_fsdp"
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_xla": True}))  # a JSON file, keys with the fsdp_ prefix, as HF allows
    assert load_config({"fsdp": "full_shard", "fsdp_config": str(path)}).strategy.name == "xla_fsdp"
    assert load_config({"fsdp": "full_shard", "fsdp_config": {"min_num_params": 10}}).strategy.name == "fsdp"


@pytest.mark.parametrize("key", ["xla_fsdp_grad_ckpt", "xla_fsdp_v2", "xla_fsdp_settings"])
def test_xla_only_keys_without_xla_are_refused(key):
    with pytest.raises(ConfigError, match=f"'{key}' applies to XLA FSDP only"):
        load_config({"fsdp": "full_shard", "fsdp_config": {key: {"a": 1} if key == "xla_fsdp_settings" else True}})


def test_hf_forms_map_onto_the_settings():
    s = resolve(
        _options(
            fsdp="full_shard auto_wrap",
            fsdp_config={
                "xla": True,
                "xla_fsdp_v2": False,
                "xla_fsdp_settings": {"compute_dtype": "bfloat16"},
                "xla_fsdp_grad_ckpt": True,
                "transformer_layer_cls_to_wrap": "Block",
            },
        )
    )
    assert (s.wrapper, s.wrap, s.activation_checkpointing, s.settings) == (
        "classic",
        ["Block"],
        True,
        {"compute_dtype": "bfloat16"},
    )
    assert resolve(_options(fsdp_config={"xla": True})).wrapper == "spmd"  # kiln's default (HF's is classic)
    assert resolve(_options(fsdp_config={"xla": True, "min_num_params": 100})).min_num_params == 100
    assert resolve(_options(fsdp="shard_grad_op", wrapper="classic")).settings == {"reshard_after_forward": False}
    assert resolve(_options(wrapper="classic", fsdp_config={"xla_fsdp_v2": True})).wrapper == "classic"  # native wins


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(fsdp_config={"xla": True, "xla_fsdp_settings": {"compute_dtype": "bfloat16"}}), "configure the classic"),
        (dict(wrap=["Block"], min_num_params=10), "set only one of them"),
        (dict(fsdp="full_shard offload"), "'offload' is not available with XLA FSDP"),
        (dict(wrapper="gspmd"), "not one of spmd, classic"),
        (dict(fsdp_config={"xla": True, "sharding_strategy": 1}), "not an XLA FSDP setting"),
    ],
)
def test_bad_settings_are_one_sentence(given, message):
    with pytest.raises(ConfigError, match=message) as err:
        resolve(_options(**given))
    assert "\n" not in str(err.value)


def test_gradient_checkpointing_needs_an_auto_wrap_policy():
    s = resolve(_options(fsdp_config={"xla": True, "xla_fsdp_grad_ckpt": True}))
    with pytest.raises(ConfigError, match="needs an auto-wrap policy"):
        check_activation_checkpointing(s, has_policy=False)
    check_activation_checkpointing(s, has_policy=True)


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
@pytest.mark.parametrize("name", ["xla", "xla_fsdp"])
def test_without_torch_xla_the_strategies_say_how_to_get_it(name, tmp_path):
    from kiln import Trainer
    from tests.helpers import TinyRegressor, base_config, regression_data

    cfg = base_config(tmp_path, strategy={"name": name})
    with pytest.raises(ConfigError, match=r"pip install kiln\[xla\]"):
        Trainer(TinyRegressor(), cfg, train_dataset=regression_data(n=8))


@pytest.mark.parametrize(
    "options, chosen",
    [
        ({}, "SPMDXLAFSDPStrategy"),
        ({"wrapper": "classic"}, "ClassicXLAFSDPStrategy"),
        ({"fsdp_config": {"xla": True, "xla_fsdp_v2": False}}, "ClassicXLAFSDPStrategy"),
        ({"fsdp_config": {"xla": True, "xla_fsdp_v2": True}}, "SPMDXLAFSDPStrategy"),
    ],
)
def test_xla_fsdp_resolves_one_class_per_wrapper(options, chosen):
    """`xla_fsdp` is one name for two classes; the options pick one before anything imports torch_xla."""
    from omegaconf import OmegaConf

    from kiln.strategies import STRATEGIES
    from kiln.strategies.xla.fsdp_base import XLAFSDPBase

    cls = STRATEGIES.get("xla_fsdp").resolve(OmegaConf.create({"strategy": {"name": "xla_fsdp", "options": options}}))
    assert cls.__name__ == chosen and issubclass(cls, XLAFSDPBase) and cls.name == "xla_fsdp"
    assert (
        len(cls.checkpoint_formats) == 1 and cls.checkpoint_formats[0] in STRATEGIES.get("xla_fsdp").checkpoint_formats
    )
