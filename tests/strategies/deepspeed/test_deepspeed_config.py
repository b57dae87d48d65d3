"""The DeepSpeed config kiln builds: HF's "auto" filling, one error for disagreeing values, kiln's
defaults taking the DeepSpeed values (accelerate's plugin route), named stages. No processes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kiln.config import load_config
from kiln.config.hf.deepspeed import finalize, process, read_user_config
from kiln.utils.errors import ConfigError


def _cfg(**extra):
    return load_config(
        {
            "learning_rate": 0.01,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "max_grad_norm": 0.5,
            "weight_decay": 0.1,
            "adam_epsilon": 1e-7,
            "warmup_steps": 3,
            "max_steps": 20,
            **extra,
        }
    )


AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def test_every_auto_value_is_filled_as_hf_documents():
    cfg = _cfg(bf16=True)
    ds = process(cfg, json.loads(json.dumps(AUTO)), world_size=2, precision="bf16", name="deepspeed")
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=16))
    ds = finalize(ds, model, cfg=cfg, max_steps=20)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16 and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"] == {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-7, "weight_decay": 0.1}
    assert ds["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 0.01,
        "warmup_num_steps": 3,
        "total_num_steps": 20,
    }
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == 256 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 256)
    assert zero["stage3_param_persistence_threshold"] == 160


def test_absent_values_come_from_kiln_so_deepspeed_defaults_cannot_drift():
    ds = process(_cfg(), {}, world_size=2, precision="fp32", name="deepspeed_stage_3")
    assert ds["gradient_clipping"] == 0.5  # DeepSpeed's own default would be 1.0
    assert ds["gradient_accumulation_steps"] == 2 and ds["zero_optimization"]["stage"] == 3
    off = process(_cfg(), {}, world_size=1, precision="fp32", name="deepspeed_stage_3_offload")["zero_optimization"]
    assert off["offload_optimizer"] == {"device": "cpu"} and off["offload_param"] == {"device": "cpu"}
    assert off["stage"] == 3


@pytest.mark.parametrize("precision, sections", [("bf16", {"bf16": {"enabled": True}}), ("fp32", {})])
def test_an_absent_precision_section_is_written_only_for_the_runs_dtype(precision, sections):
    ds = process(_cfg(), {}, world_size=1, precision=precision, name="deepspeed")
    assert {k: ds[k] for k in ("fp16", "bf16") if k in ds} == sections


def test_a_value_of_another_kind_than_kilns_is_a_mismatch_not_a_match():
    with pytest.raises(ConfigError, match=r"gradient_clipping='0.5' vs kiln train.max_grad_norm=0.5"):
        process(_cfg(), {"gradient_clipping": "0.5"}, world_size=1, precision="fp32", name="deepspeed")
    same = {"gradient_clipping": 0.5, "optimizer": {"params": {"betas": [0.9, 0.999]}}}  # numbers and lists by value
    assert process(_cfg(), same, world_size=1, precision="fp32", name="deepspeed")["gradient_clipping"] == 0.5


def test_values_set_on_both_sides_that_differ_are_one_error_naming_both():
    user = {
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
        "fp16": {"enabled": True},
    }
    with pytest.raises(ConfigError) as err:
        process(_cfg(bf16=True), user, world_size=2, precision="bf16", name="deepspeed")
    text = str(err.value)
    for part in (
        "gradient_clipping=1.0",
        "max_grad_norm=0.5",
        "gradient_accumulation_steps=4",
        "optimizer.params.lr=0.5",
        "optim.lr=0.01",
        "fp16.enabled",
        "precision.name='bf16'",
    ):
        assert part in text, text
    assert "\n" not in text


def test_a_kiln_value_at_its_default_takes_the_deepspeed_value():
    """accelerate's plugin settings (gradient_clipping: 0.7, gradient_accumulation_steps) arrive in the
    DeepSpeed config; kiln's config then holds them, so there is one copy."""
    user = {
        "gradient_clipping": 0.7,
        "gradient_accumulation_steps": 3,
        "optimizer": {"params": {"lr": 0.25}},
        "scheduler": {"params": {"warmup_max_lr": 0.5}},
    }
    cfg = load_config({"max_steps": 4, "deepspeed": user})  # as it loads: the config is read-only after
    assert cfg.train.max_grad_norm == 0.7 and cfg.train.gradient_accumulation_steps == 3 and cfg.optim.lr == 0.25
    with pytest.raises(ConfigError, match=r"warmup_max_lr=0.5 vs kiln optim.lr=0.25"):  # lr is no longer a default
        process(cfg, read_user_config(cfg.strategy.options.config), world_size=2, precision="fp32", name="deepspeed")
    del user["scheduler"]
    cfg = load_config({"max_steps": 4, "deepspeed": user})
    before = dict(cfg.train)
    ds = process(cfg, read_user_config(cfg.strategy.options.config), world_size=2, precision="fp32", name="deepspeed")
    assert ds["train_batch_size"] == 2 * 3 * cfg.data.per_device_train_batch_size and ds["gradient_clipping"] == 0.7
    assert dict(cfg.train) == before  # the strategy's processing reads the config only


def test_values_set_by_the_user_are_not_replaced_by_the_deepspeed_config():
    cfg = load_config({"max_steps": 4, "max_grad_norm": 0.3, "deepspeed": {"gradient_clipping": 0.7}})
    assert cfg.train.max_grad_norm == 0.3
    with pytest.raises(ConfigError, match=r"gradient_clipping=0.7 vs kiln train.max_grad_norm=0.3"):
        process(cfg, read_user_config(cfg.strategy.options.config), world_size=1, precision="fp32", name="deepspeed")
    other = load_config({"max_steps": 4, "strategy": "ddp", "strategy.options.config": {"gradient_clipping": 0.7}})
    assert other.train.max_grad_norm == 1.0  # only a DeepSpeed run reads a DeepSpeed config


def test_unreadable_configs_are_one_sentence(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_user_config(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        read_user_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="hidden_size"):
        finalize({"zero_optimization": {"reduce_bucket_size": "auto"}}, SimpleNamespace(), cfg=_cfg(), max_steps=20)


def test_missing_deepspeed_and_missing_compiler_are_one_sentence(monkeypatch):
    import subprocess
    import sys

    from kiln.strategies.deepspeed.runtime import compiling, import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ConfigError, match=r"pip install kiln\[deepspeed\]"):
        import_deepspeed()

    def no_compiler():
        raise subprocess.CalledProcessError(1, ["/bin/false", "--version"])

    with pytest.raises(ConfigError, match="install g\\+\\+"):
        compiling(no_compiler)

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    with pytest.raises(ConfigError, match="pip install ninja"):
        compiling(no_ninja)


def test_offload_without_a_deepspeed_optimizer_is_refused_for_non_adam():
    from kiln.strategies.deepspeed.optimizer import ds_optimizer_from_kiln

    with pytest.raises(ConfigError, match="ZeRO-Offload needs a DeepSpeed optimizer"):
        ds_optimizer_from_kiln(_cfg(optim="sgd"))
    assert ds_optimizer_from_kiln(_cfg())["params"]["lr"] == 0.01


@pytest.mark.parametrize("warmup", [{"warmup_steps": 7}, {"warmup_steps": 0.25}, {"warmup_steps": 0.1}, {}])
@pytest.mark.parametrize("steps", [13, 40])
def test_auto_scheduler_steps_follow_hf_rule(warmup, steps):
    """total_num_steps / warmup_num_steps as HF's `trainer_config_finalize` fills them (run here on
    the same values), from the step count the loop passes to setup (not `max_steps` in the config:
    an epoch-based run has none)."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf_args = TrainingArguments(output_dir="unused", report_to=[], **warmup)
    scheduler = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}
    hf = HfTrainerDeepSpeedConfig({"scheduler": json.loads(json.dumps(scheduler))})
    hf.trainer_config_finalize(hf_args, SimpleNamespace(config=None), steps)
    cfg = load_config({"num_train_epochs": 2, **warmup})
    ours = finalize(
        {"scheduler": json.loads(json.dumps(scheduler)), "zero_optimization": {}}, None, cfg=cfg, max_steps=steps
    )
    assert ours["scheduler"]["params"] == hf.config["scheduler"]["params"]


def test_scheduler_step_numbers_that_disagree_with_the_run_are_one_error():
    user = {
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 99}},
        "zero_optimization": {},
    }
    with pytest.raises(ConfigError) as err:
        finalize(user, None, cfg=_cfg(), max_steps=20)
    assert "total_num_steps=99" in str(err.value) and "warmup_num_steps=5" in str(err.value)
    kept = finalize(
        {"scheduler": {"params": {"warmup_num_steps": 5, "total_num_steps": 20}}},
        None,
        cfg=_cfg(warmup_steps=0),
        max_steps=20,
    )
    assert kept["scheduler"]["params"] == {"warmup_num_steps": 5, "total_num_steps": 20}  # kiln's warmup at its default
    with pytest.raises(ConfigError, match="not known yet"):
        finalize({"scheduler": {"params": {"total_num_steps": "auto"}}}, None, cfg=_cfg(), max_steps=None)


def test_an_optimizer_that_owns_backward_is_refused_before_deepspeed_starts():
    """LOMO updates parameters inside backward, which DeepSpeed's engine runs itself."""
    import torch

    from kiln.precision import build_precision
    from kiln.strategies import build_strategy

    cfg = _cfg(strategy="deepspeed", deepspeed={"zero_optimization": {"stage": 2}})
    strategy = build_strategy(cfg, build_precision(cfg))

    class OwnsBackward(torch.optim.SGD):
        owns_backward = True

    module = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="OwnsBackward updates parameters inside backward, which DeepSpeed"):
        strategy.setup(module, lambda m: OwnsBackward(m.parameters(), lr=0.1), max_steps=20)


def test_the_finished_configs_dtype_is_the_enabled_section():
    from kiln.config.hf.deepspeed import dtype_of

    assert dtype_of({}) is None and dtype_of({"bf16": {"enabled": False}, "fp16": {"enabled": False}}) is None
    assert dtype_of({"bf16": {"enabled": False}, "fp16": {"enabled": True}}) == "fp16"
    assert dtype_of({"fp16": {"enabled": False}, "bf16": {"enabled": True}}) == "bf16"
    assert dtype_of({"bf16": {"enabled": "auto"}, "fp16": True}) is None  # only a filled-in section counts


def test_deepspeeds_own_printing_is_off_unless_the_user_asks_for_it():
    """kiln logs the steps itself; DeepSpeed's progress prints and timing breakdown would duplicate it."""
    ds = process(_cfg(), {}, world_size=1, precision="fp32", name="deepspeed")
    assert ds["steps_per_print"] == 10**9 and ds["wall_clock_breakdown"] is False
    own = {"steps_per_print": 5, "wall_clock_breakdown": True}
    assert {
        k: v for k, v in process(_cfg(), own, world_size=1, precision="fp32", name="deepspeed").items() if k in own
    } == own
