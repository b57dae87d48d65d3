"""An explicit `strategy` against HF's arguments that pick one themselves (`deepspeed`, `fsdp`,
`fsdp_config` and its older flat keys, `parallelism_config`, `use_mps_device`), issue 52 item 7. A
contradiction is refused in the sentence two contradicting HF names get (`fp16` with `bf16`), in either
order of the keys; a name of the same family stays (a preset such as `deepspeed_stage_3` keeps its
stage); `auto`, or no name, takes HF's choice as before."""

from __future__ import annotations

import re

import pytest

from kiln.config import load_config
from kiln.utils.errors import ConfigError
from tests.helpers import TinyRegressor, base_config, regression_data

DS = {"zero_optimization": {"stage": 2}}

#: (explicit strategy entry, HF argument, its value, the name the HF argument asks for)
CONFLICTS = [
    (("strategy", "fsdp"), "deepspeed", DS, "deepspeed"),
    (("strategy", "ddp"), "deepspeed", DS, "deepspeed"),
    (("strategy", "single"), "deepspeed", "ds.json", "deepspeed"),
    (("strategy", "single"), "fsdp", "full_shard", "fsdp"),
    (("strategy", "ddp"), "fsdp", "full_shard auto_wrap", "fsdp"),
    (("strategy", "deepspeed"), "fsdp", "full_shard", "fsdp"),
    (("strategy", "model_parallel"), "fsdp", "full_shard", "fsdp"),
    (("strategy", "xla"), "fsdp", "full_shard", "fsdp"),
    (("strategy", "ddp"), "fsdp_config", {"min_num_params": 10}, "fsdp"),
    (("strategy", "deepspeed_stage_3"), "fsdp_config", {"min_num_params": 10}, "fsdp"),
    (("strategy", "single"), "fsdp_min_num_params", 10, "fsdp"),
    (("strategy", "ddp"), "fsdp_transformer_layer_cls_to_wrap", "Block", "fsdp"),
    (("strategy", "ddp"), "parallelism_config", {"tp_size": 2}, "model_parallel"),
    (("strategy", "ddp"), "use_mps_device", True, "mps"),
    (("strategy", {"name": "ddp", "timeout": 60}), "deepspeed", DS, "deepspeed"),
    (("strategy.name", "single"), "fsdp", "full_shard", "fsdp"),
]


def _sentence(first: str, first_value, second: str, second_value, a: str, b: str) -> str:
    """The flat-name conflict's sentence (kiln.config.conflicts.different), as a regex."""
    return re.escape(
        f"{first}={first_value!r} and {second}={second_value!r} ask for different strategy.name "
        f"({a!r} vs {b!r}); keep one of them."
    )


# the order of the keys changes nothing: both orders for a few, the given order for the rest (each load costs)
ORDERS = [(case, "hf argument first") for case in CONFLICTS[:4]] + [(case, "strategy first") for case in CONFLICTS]


@pytest.mark.parametrize("case, order", ORDERS, ids=lambda v: str(v)[:40])
def test_an_explicit_strategy_that_an_hf_argument_contradicts_is_refused(tmp_path, case, order):
    explicit, key, value, wants = case
    given, name = explicit
    items = [explicit, (key, value)] if order == "strategy first" else [(key, value), explicit]
    shown = name["name"] if isinstance(name, dict) else name
    with pytest.raises(ConfigError, match="^" + _sentence(given, name, key, value, shown, wants) + "$"):
        load_config({"output_dir": str(tmp_path), **dict(items)})


def test_the_sentence_is_the_flat_name_conflicts(tmp_path):
    """Two HF names that pick different strategies were refused before; the explicit strategy now gets
    the same sentence."""
    with pytest.raises(ConfigError, match=_sentence("deepspeed", DS, "fsdp", "full_shard", "deepspeed", "fsdp")):
        load_config({"output_dir": str(tmp_path), "deepspeed": DS, "fsdp": "full_shard"})
    # HF arguments that name no strategy of their own still may not contradict one that does
    with pytest.raises(ConfigError, match=_sentence("deepspeed", DS, "fsdp_config", {"a": 1}, "deepspeed", "fsdp")):
        load_config({"output_dir": str(tmp_path), "deepspeed": DS, "fsdp_config": {"a": 1}})


@pytest.mark.parametrize(
    "explicit, key, value, name",
    [
        ("deepspeed", "deepspeed", DS, "deepspeed"),
        (
            "deepspeed_stage_3",
            "deepspeed",
            {"train_batch_size": "auto"},
            "deepspeed_stage_3",
        ),  # the preset's stage stays
        ("deepspeed_stage_2_offload", "deepspeed", "ds.json", "deepspeed_stage_2_offload"),
        ("fsdp", "fsdp", "full_shard", "fsdp"),
        ("fsdp2", "fsdp", "full_shard", "fsdp2"),
        ("fsdp", "fsdp_config", {"min_num_params": 10}, "fsdp"),
        ("xla_fsdp", "fsdp", "full_shard", "xla_fsdp"),
        ("model_parallel", "parallelism_config", {"tp_size": 2}, "model_parallel"),
        ("mps", "use_mps_device", True, "mps"),
        ("ddp", "use_mps_device", False, "ddp"),  # switched off: asks for nothing
        ("ddp", "deepspeed", None, "ddp"),
        ("single", "fsdp", "", "single"),
    ],
)
def test_an_agreeing_name_stays(tmp_path, explicit, key, value, name):
    assert load_config({"output_dir": str(tmp_path), "strategy": explicit, key: value}).strategy.name == name


def test_a_preset_stays_when_the_hf_argument_comes_first(tmp_path):
    cfg = load_config({"output_dir": str(tmp_path), "deepspeed": DS, "strategy": "deepspeed_stage_3"})
    assert cfg.strategy.name == "deepspeed_stage_3"


@pytest.mark.parametrize("strategy", [{"strategy": "auto"}, {"strategy": {"timeout": 60}}])
@pytest.mark.parametrize(
    "key, value, name",
    [
        ("deepspeed", DS, "deepspeed"),
        ("fsdp", "full_shard", "fsdp"),
        ("parallelism_config", {"tp_size": 2}, "model_parallel"),
        ("use_mps_device", True, "mps"),
        ("fsdp_config", {"min_num_params": 10}, "auto"),  # configures only: no name
    ],
)
def test_auto_takes_hfs_choice_in_either_order(tmp_path, strategy, key, value, name):
    first = load_config({"output_dir": str(tmp_path), **strategy, key: value})
    last = load_config({"output_dir": str(tmp_path), key: value, **strategy})
    assert first.strategy.name == last.strategy.name == name


def test_hf_fsdp_with_xla_routes_to_xla_fsdp_under_an_explicit_fsdp(tmp_path):
    cfg = load_config(
        {"output_dir": str(tmp_path), "strategy": "fsdp", "fsdp": "full_shard", "fsdp_config": {"xla": True}}
    )
    assert cfg.strategy.name == "xla_fsdp"


def test_the_trainer_refuses_before_building_anything(tmp_path):
    """Before this, `strategy: single` with `fsdp: full_shard` ran FSDP."""
    model = TinyRegressor()
    with pytest.raises(ConfigError, match="strategy='single' and fsdp='full_shard' ask for different strategy.name"):
        from kiln import Trainer

        Trainer(model, base_config(tmp_path, strategy="single", fsdp="full_shard"), train_dataset=regression_data(8))
