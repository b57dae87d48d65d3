"""Every field of the installed `transformers.TrainingArguments` is accounted for: a plain alias of a
config key, a translated option with a test named after it, or one of the few refusals that
docs/migration.md lists with the reason. A field new in transformers fails here, not silently."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.config.hf import aliases
from kiln.config.hf import rewrites as hf_rewrites
from kiln.config.schema import TrainingConfig
from kiln.utils.errors import ConfigError

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
HF_FIELDS = [
    f for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments) if f.init
]  # TrainingArguments + Seq2Seq
TOP_LEVEL = {f.name for f in dataclasses.fields(TrainingConfig)}


def _test_names() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        names.update(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M))
    return names


def _hf_default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return None


@pytest.mark.parametrize("field", HF_FIELDS, ids=lambda f: f.name)
def test_every_training_argument_is_mapped_implemented_or_refused(field):
    name = field.name
    if name in TOP_LEVEL or name in aliases.PATHS or name in aliases.IGNORED:
        kind = "mapped"
    elif name in aliases.UNSUPPORTED:
        kind = "refused"
        assert f"`{name}`" in (REPO / "docs" / "migration.md").read_text(), (
            f"{name} is refused but not in docs/migration.md"
        )
    elif name in aliases.REWRITES:
        kind = "translated"
        tests = [t for t in _test_names() if name in t]
        assert tests, f"HF's {name!r} is translated by kiln.config.hf.aliases but no test is named after it"
    else:
        pytest.fail(
            f"transformers.TrainingArguments.{name} is new to kiln: map it in kiln/config/hf/aliases.py, "
            "implement it (with a test named after it), or refuse it in UNSUPPORTED and docs/migration.md"
        )
    default = _hf_default(field)
    if default is not None and name != "output_dir":  # None is HF's "unset" (handled with args=TrainingArguments)
        load_config({name: default})  # HF's default always loads, whatever the kind
    assert kind


def test_refusals_are_few_and_each_names_the_way_forward():
    assert len(aliases.UNSUPPORTED) <= 14
    for name, reason in aliases.UNSUPPORTED.items():
        value = -5 if name == "past_index" else True
        with pytest.raises(ConfigError) as err:
            load_config({name: value})
        assert str(err.value) == f"{name}={value!r} is not supported by kiln: {reason}."


# -- the translated options ---------------------------------------------------------------------------


def test_use_mps_device_selects_the_mps_strategy():
    assert load_config({"use_mps_device": True}).strategy.name == "mps"
    assert load_config({"use_mps_device": False}).strategy.name == "auto"


def test_tpu_metrics_debug_needs_an_xla_strategy():
    for source in ({"tpu_metrics_debug": True}, {"debug": "tpu_metrics_debug"}):
        with pytest.raises(
            ConfigError,
            match=r"^debug 'tpu_metrics_debug' prints the XLA metrics report, but strategy "
            r"is 'single'; use strategy xla or xla_fsdp, or drop it\.$",
        ):
            load_config({**source, "strategy": "single"})
    assert hf_rewrites.tpu_metrics_debug(True) == {"train.debug": ["tpu_metrics_debug"]}
    assert hf_rewrites.tpu_metrics_debug(False) == {}


def test_debug_accepts_hf_strings_lists_and_enums():
    from transformers.debug_utils import DebugOption

    assert load_config({"debug": "underflow_overflow"}).train.debug == ["underflow_overflow"]
    assert load_config({"debug": [DebugOption.UNDERFLOW_OVERFLOW]}).train.debug == ["underflow_overflow"]
    assert load_config({"debug": ""}).train.debug == []
    with pytest.raises(
        ConfigError,
        match=r"^debug='overflow' names unknown options \['overflow'\]; choose from "
        r"underflow_overflow, tpu_metrics_debug\.$",
    ):
        load_config({"debug": "overflow"})


def test_accelerator_config_maps_the_data_options():
    from transformers.trainer_pt_utils import AcceleratorConfig

    hf = AcceleratorConfig(split_batches=True, even_batches=False, dispatch_batches=True)
    data = load_config({"accelerator_config": hf}).data
    assert (data.split_batches, data.even_batches, data.dispatch_batches, data.use_seedable_sampler) == (
        True,
        False,
        True,
        True,
    )
    assert (
        load_config({"accelerator_config": AcceleratorConfig()}).data.dispatch_batches is False
    )  # None: kiln's default
    with pytest.raises(
        ConfigError, match=r"^accelerator_config non_blocking=True is not supported: kiln already copies"
    ):
        load_config({"accelerator_config": {"non_blocking": True}})
    with pytest.raises(
        ConfigError, match=r"^accelerator_config has unknown key 'splitbatches'; kiln reads split_batches"
    ):
        load_config({"accelerator_config": {"splitbatches": True}})


def test_accelerator_config_from_a_json_file(tmp_path):
    path = tmp_path / "acc.json"
    path.write_text('{"even_batches": false}')
    assert load_config({"accelerator_config": str(path)}).data.even_batches is False


@pytest.mark.parametrize("name", ["split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler"])
def test_flat_accelerator_names_map_to_data(name):
    value = name != "even_batches"
    if name == "use_seedable_sampler":
        assert load_config({name: True}).data.use_seedable_sampler is True
        return
    assert getattr(load_config({name: value}).data, name) is value
    assert getattr(load_config({name: None}).data, name) is getattr(load_config({}).data, name)


def test_use_seedable_sampler_false_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^data\.use_seedable_sampler=false would draw the shuffle order from the "
        r"global RNG, which a resumed run cannot reproduce",
    ):
        load_config({"accelerator_config": {"use_seedable_sampler": False}})


def test_include_for_metrics():
    assert load_config({"include_for_metrics": ["inputs"]}).eval.include_inputs_for_metrics is True
    assert load_config({"include_for_metrics": []}).eval.include_inputs_for_metrics is False
    with pytest.raises(
        ConfigError, match=r"^include_for_metrics 'loss' is not supported: kiln reports the loss as eval_loss"
    ):
        load_config({"include_for_metrics": ["inputs", "loss"]})


def test_train_sampling_strategy():
    assert load_config({"train_sampling_strategy": "group_by_length"}).data.group_by_length is True
    assert load_config({"train_sampling_strategy": "random"}).data.group_by_length is False
    with pytest.raises(
        ConfigError,
        match=r"^train_sampling_strategy='sequential' is not supported; use 'random' or 'group_by_length'\.$",
    ):
        load_config({"train_sampling_strategy": "sequential"})


def test_ddp_static_graph():
    assert load_config({"ddp_static_graph": True}).strategy.static_graph is True
    assert load_config({"ddp_static_graph": None}).strategy.static_graph is False


def test_use_cache_is_set_on_the_model_config(tmp_path):
    from types import SimpleNamespace

    from torch import nn

    from kiln import Trainer

    model = nn.Linear(2, 1)
    model.config = SimpleNamespace(use_cache=True)
    Trainer(model, {"output_dir": str(tmp_path), "use_cache": False, "strategy": {"name": "single", "device": "cpu"}})
    assert model.config.use_cache is False
    Trainer(model, {"output_dir": str(tmp_path), "strategy": {"name": "single", "device": "cpu"}})
    assert model.config.use_cache is False  # unset: the model's own value stays


def test_torch_empty_cache_steps_empties_every_n_steps():
    from types import SimpleNamespace

    from kiln.engine.callbacks.empty_cache import EmptyCacheCallback

    calls: list[int] = []
    state = SimpleNamespace(global_step=0)
    callback = EmptyCacheCallback(3, lambda: calls.append(state.global_step))
    for step in range(1, 10):
        state.global_step = step
        callback.on_step_end(None, state, None)
    assert calls == [3, 6, 9]
    assert load_config({"torch_empty_cache_steps": 3}).train.torch_empty_cache_steps == 3


def test_bf16_full_eval_and_fp16_full_eval():
    assert load_config({"bf16_full_eval": True}).precision.full_eval == "bf16"
    assert load_config({"fp16_full_eval": True}).precision.full_eval == "fp16"
    assert load_config({"bf16_full_eval": False}).precision.full_eval is None


def test_use_cpu_and_no_cuda_pick_the_cpu():
    assert load_config({"use_cpu": True}).strategy.device == "cpu"
    assert load_config({"no_cuda": "true"}).strategy.device == "cpu"
    assert load_config({"use_cpu": False}).strategy.device is None


def test_fsdp_config_goes_to_the_strategy_options():
    cfg = load_config({"fsdp": "full_shard auto_wrap", "fsdp_config": {"min_num_params": 10}})
    assert cfg.strategy.name == "fsdp" and list(cfg.strategy.options.fsdp) == ["full_shard", "auto_wrap"]
    assert dict(cfg.strategy.options.fsdp_config) == {"min_num_params": 10}


def test_push_to_hub_is_refused_with_how_to_upload():
    assert load_config({"push_to_hub": False}).output_dir == "tmp_trainer"
    with pytest.raises(
        ConfigError,
        match=r"^push_to_hub is not supported: kiln runs offline\. Save with "
        r"trainer\.save_model\(\) and upload the folder yourself\.$",
    ):
        load_config({"push_to_hub": True})


def test_generation_config_becomes_generate_kwargs():
    from transformers import GenerationConfig

    kwargs = load_config({"generation_config": GenerationConfig(num_beams=3, max_new_tokens=7)}).eval.generation_kwargs
    assert dict(kwargs) == {"num_beams": 3, "max_new_tokens": 7}
    assert dict(load_config({"generation_config": {"do_sample": False}}).eval.generation_kwargs) == {"do_sample": False}
    with pytest.raises(ConfigError, match=r"^generation_config='t5-small' must be a GenerationConfig or a dict"):
        load_config({"generation_config": "t5-small"})
