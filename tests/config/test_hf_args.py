"""`Trainer(model, args=TrainingArguments(...))`: the HF object (or a JSON dump of its to_dict()) is a
kiln config; transformers-5 keys load, on-by-user features kiln lacks are refused in one sentence."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from kiln import Trainer
from kiln.config import ConfigError, load_config

transformers = pytest.importorskip("transformers")


class HFRegressor(nn.Module):
    """An HF-contract model (called as model(**batch), returns a dict with the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}


def _data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(-1)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)


@pytest.mark.parametrize("cls", ["TrainingArguments", "Seq2SeqTrainingArguments"])
def test_every_default_key_loads_from_object_and_json_dump(tmp_path, cls):
    args = getattr(transformers, cls)(output_dir=str(tmp_path))
    from_object = load_config(args)
    from_dump = load_config(json.loads(json.dumps(args.to_dict())))
    assert from_object == from_dump
    assert from_object.optim.name == "adamw_torch_fused" and from_object.output_dir == str(tmp_path)  # HF 5 default


def test_transformers5_values_are_converted(tmp_path):
    cfg = load_config(
        _args(
            tmp_path,
            learning_rate=3e-4,
            warmup_steps=0.1,
            include_num_input_tokens_seen=True,
            activation_checkpointing=True,
            train_sampling_strategy="group_by_length",
            ddp_static_graph=True,
            include_for_metrics=["inputs"],
            lr_scheduler_kwargs={"power": 2.0},
            per_device_train_batch_size=4,
            bf16=True,
            use_cpu=True,
        )
    )
    assert cfg.optim.lr == 3e-4 and cfg.scheduler.warmup_ratio == 0.1 and cfg.scheduler.warmup_steps == 0
    assert cfg.train.include_num_input_tokens_seen is True and cfg.train.gradient_checkpointing is True
    assert cfg.data.group_by_length is True and cfg.strategy.static_graph is True
    assert cfg.eval.include_inputs_for_metrics is True and cfg.scheduler.kwargs == {"power": 2.0}
    assert cfg.data.per_device_train_batch_size == 4 and cfg.precision.name == "bf16" and cfg.strategy.device == "cpu"
    assert load_config({"warmup_steps": 30}).scheduler.warmup_steps == 30
    assert load_config({"include_num_input_tokens_seen": "no"}).train.include_num_input_tokens_seen is False


def test_lr_scheduler_kwargs_accepts_mappings_and_json_strings(tmp_path):
    assert load_config(_args(tmp_path, lr_scheduler_kwargs={"power": 2.0})).scheduler.kwargs == {"power": 2.0}
    assert load_config({"lr_scheduler_kwargs": '{"power": 3.0}'}).scheduler.kwargs == {"power": 3.0}
    assert load_config({"lr_scheduler_kwargs": None}).scheduler.kwargs == {}


def test_activation_checkpointing_and_activation_checkpointing_kwargs_mean_gradient_checkpointing(tmp_path):
    cfg = load_config(
        _args(tmp_path, activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})
    )
    assert cfg.train.gradient_checkpointing is True
    assert dict(cfg.train.gradient_checkpointing_kwargs) == {"use_reentrant": False}
    assert load_config(_args(tmp_path, activation_checkpointing=False)).train.gradient_checkpointing is False


def test_gradient_checkpointing_kwargs_every_n_layers_is_the_section_s_every_and_the_rest_is_one_sentence():
    for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        cfg = load_config({"gradient_checkpointing": True, name: {"every_n_layers": 3, "use_reentrant": False}})
        assert cfg.activation_checkpointing.every == 3
        assert dict(cfg.train.gradient_checkpointing_kwargs) == {"use_reentrant": False}
    assert load_config({"activation_checkpointing_kwargs": '{"every_n_layers": 2}'}).activation_checkpointing.every == 2
    for kwargs, words in (  # named by the HF name given
        ({"use_reentrant": True}, "use_reentrant: true is not supported: kiln checkpoints non-reentrant"),
        ({"offload": True}, "offload is not supported by kiln (activations stay on the device)"),
        ({"preserve_rng_state": False}, "preserve_rng_state is not supported by kiln (it takes use_reentrant: false"),
        ("[1]", "must be a mapping"),
    ):
        with pytest.raises(ConfigError, match="^" + re.escape(f"activation_checkpointing_kwargs {words}")):
            load_config({"gradient_checkpointing": True, "activation_checkpointing_kwargs": kwargs})
    with pytest.raises(ConfigError, match="every_n_layers is activation_checkpointing.every in kiln"):
        load_config({"train": {"gradient_checkpointing_kwargs": {"every_n_layers": 2}}})


def test_the_section_and_hf_s_switch_side_by_side():
    from kiln.config.hf.dialect import is_hf_dialect

    assert load_config({"activation_checkpointing": True}).train.gradient_checkpointing is True
    assert is_hf_dialect({"activation_checkpointing": True}) and not is_hf_dialect({"activation_checkpointing": {}})
    section = load_config({"activation_checkpointing": {"mode": "selective", "ops": ["aten.mm"]}})
    assert (section.activation_checkpointing.mode, list(section.activation_checkpointing.ops)) == (
        "selective",
        ["aten.mm"],
    )
    for cfg, words in (
        ({"activation_checkpointing": {"mode": "partial"}}, "activation_checkpointing.mode is 'partial'; use full or"),
        ({"activation_checkpointing": {"mode": "full", "every": 0}}, "activation_checkpointing.every is 0"),
        ({"activation_checkpointing": {"ops": ["aten.mm"]}}, "set mode: selective or remove ops"),
        (
            {"gradient_checkpointing": True, "activation_checkpointing": {"mode": "selective"}},
            "gradient_checkpointing: true means activation_checkpointing.mode full, but the mode is selective",
        ),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config(cfg)


@pytest.mark.parametrize("value, expected", [(True, True), ("all", True), ("no", False), (False, False)])
def test_include_num_input_tokens_seen_takes_hf5_strings(value, expected):
    assert load_config({"include_num_input_tokens_seen": value}).train.include_num_input_tokens_seen is expected


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"include_for_metrics": ["loss"]}, "only 'inputs'"),
        ({"train_sampling_strategy": "sequential"}, "use 'random' or 'group_by_length'"),
    ],
)
def test_features_kiln_lacks_are_refused_when_on(tmp_path, kw, words):
    with pytest.raises(ConfigError, match="^[^\n]*$") as err:
        load_config(_args(tmp_path, **kw))
    assert words in str(err.value)


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(ConfigError, match=r"fp16=True and bf16=True ask for different precision.name"):
        load_config({"fp16": True, "bf16": True})
    with pytest.raises(ConfigError, match="keep one of them"):
        load_config({"deepspeed": "ds.json", "fsdp": "full_shard"})
    # a flat HF name over a nested key is an override (hyperparameter_search's {**config, **best.hyperparameters})
    assert load_config({"optim": {"lr": 0.01}, "learning_rate": 0.05}).optim.lr == 0.05
    assert load_config({"fp16": False, "bf16": True}).precision.name == "bf16"


def test_trainer_takes_args_keyword_and_matches_hf_trainer(tmp_path):
    """The same TrainingArguments give the same weights in kiln and in HF's Trainer (one batch holds the
    whole dataset, so the two samplers' different orders cannot matter)."""
    data = _data()
    kw = dict(
        learning_rate=0.05,
        per_device_train_batch_size=16,
        max_steps=4,
        save_strategy="no",
        logging_steps=1,
        warmup_steps=1,
        weight_decay=0.01,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    hf_model = HFRegressor()
    kiln_model = HFRegressor()
    kiln_model.load_state_dict(hf_model.state_dict())
    transformers.Trainer(model=hf_model, args=_args(tmp_path / "hf", **kw), train_dataset=data).train()
    Trainer(model=kiln_model, args=_args(tmp_path / "kiln", **kw), train_dataset=data).train()
    for (name, a), b in zip(hf_model.state_dict().items(), kiln_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(kiln_model.net[0].weight, HFRegressor().net[0].weight)  # it did train


def test_args_and_config_together_are_refused(tmp_path):
    with pytest.raises(Exception, match="both `config=` and `args=`"):
        Trainer(HFRegressor(), {"max_steps": 1}, args=_args(tmp_path))
