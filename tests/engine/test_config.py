"""Config loading: HF names, shorthand, overrides, and one clear sentence for each bad input."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.config import ConfigError, load_config
from tests.helpers import TinyRegressor, base_config, regression_data


def test_hf_flat_names_map_onto_the_tree():
    cfg = load_config(
        {
            "learning_rate": 3e-4,
            "per_device_train_batch_size": 16,
            "gradient_accumulation_steps": 4,
            "max_steps": 100,
            "num_train_epochs": 2,
            "warmup_ratio": 0.1,
            "lr_scheduler_type": "cosine",
            "weight_decay": 0.01,
            "adam_beta1": 0.8,
            "adam_beta2": 0.95,
            "adam_epsilon": 1e-6,
            "max_grad_norm": 0.5,
            "seed": 3,
            "data_seed": 4,
            "output_dir": "o",
            "logging_steps": 10,
            "optim": "sgd",
            "evaluation_strategy": "steps",
            "eval_steps": 5,
            "bf16": True,
            "report_to": "none",
            "ddp_backend": "gloo",
        }
    )
    assert cfg.optim.lr == 3e-4 and cfg.optim.name == "sgd" and cfg.optim.adam_beta2 == 0.95
    assert cfg.data.per_device_train_batch_size == 16 and cfg.train.gradient_accumulation_steps == 4
    assert cfg.scheduler.name == "cosine" and cfg.scheduler.warmup_ratio == 0.1
    assert cfg.eval.strategy == "steps" and cfg.eval.steps == 5 and cfg.log.steps == 10
    assert cfg.precision.name == "bf16" and cfg.log.report_to == ["none"] and cfg.strategy.backend == "gloo"


def test_hf_defaults():
    cfg = load_config(None)
    assert (
        cfg.optim.name == "adamw_torch_fused" and cfg.optim.lr == 5e-5 and cfg.scheduler.name == "linear"
    )  # HF 5, torch >= 2.8
    assert cfg.train.max_grad_norm == 1.0 and cfg.seed == 42 and cfg.train.num_train_epochs == 3.0


def test_yaml_file_and_dotlist_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.1\nstrategy: ddp\nmax_steps: 7\n")
    cfg = load_config(str(path), ["learning_rate=0.5", "train.max_steps=9", "precision=bf16", "strategy.timeout=60"])
    assert cfg.optim.lr == 0.5 and cfg.train.max_steps == 9 and cfg.strategy.name == "ddp"
    assert cfg.precision.name == "bf16" and cfg.strategy.timeout == 60


def test_strategy_mapping_keeps_unknown_keys_as_options():
    cfg = load_config({"strategy": {"name": "fsdp", "sharding": "full_shard", "cpu_offload": True}})
    assert cfg.strategy.name == "fsdp" and cfg.strategy.options == {"sharding": "full_shard", "cpu_offload": True}


@pytest.mark.parametrize(
    "source, fragment",
    [
        ({"learning_rat": 1e-3}, "Unknown config key 'learning_rat'. Did you mean 'learning_rate'?"),
        ({"optim": {"lrr": 1}}, "Unknown config key 'optim.lrr'"),
        ({"max_steps": "ten"}, "'train.max_steps' expects int, got 'ten'"),
        ({"optim": "adamw_turbo"}, "Unknown optimizer 'adamw_turbo' in `optim.name`"),
        ({"lr_scheduler_type": "cosin"}, "Did you mean 'cosine'?"),
        ({"strategy": "dpp"}, "Unknown strategy 'dpp' in `strategy.name`. Did you mean 'ddp'?"),
        ({"precision": "fp7"}, "Unknown precision plugin 'fp7'"),
        ({"eval_strategy": "sometimes"}, "'eval.strategy' is 'sometimes'; choose one of no, steps, epoch"),
        ({"gradient_accumulation_steps": 0}, "'train.gradient_accumulation_steps' must be > 0"),
        ({"logging_steps": 2.5}, "'log.steps' must be an integer >= 1 or a ratio in (0, 1)"),
        ({"report_to": ["tensorbord"]}, "Unknown logger 'tensorbord'"),
        ({"push_to_hub": True}, "push_to_hub is not supported"),
        ({"load_best_model_at_end": True}, "load_best_model_at_end needs evaluation during training"),
        ({"past_index": 2}, "past_index=2 is not supported by kiln"),
        (
            {"accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 2}}},
            "accelerator_config gradient_accumulation_kwargs={'num_steps': 2} is not supported: use train.gradient_accumulation_steps",
        ),
        (
            {"save_strategy": "best", "metric_for_best_model": "loss"},
            "save.strategy 'best' saves when an evaluation improves the best metric, but eval.strategy is 'no'",
        ),
        (
            {"save_strategy": "best", "eval_strategy": "steps"},  # HF's sentence, then kiln's key
            "`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
            "`args.load_best_model_at_end` is set to `True`: set eval.metric_for_best_model",
        ),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 5},
            "save.steps (5) to be a multiple of eval.steps (3)",
        ),
    ],
)
def test_bad_inputs_give_one_clear_sentence(source, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(source)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_save_best_without_metric_is_fine_with_load_best_model_at_end():
    """HF's arguments default metric_for_best_model to the loss under load_best_model_at_end."""
    load_config({"save_strategy": "best", "eval_strategy": "steps", "load_best_model_at_end": True})


def test_unknown_name_lists_valid_names():
    with pytest.raises(ConfigError, match="Valid names: .*adamw_torch.*sgd"):
        load_config({"optim": "nope"})
    with pytest.raises(ConfigError, match="Valid names: .*ddp.*single"):
        load_config({"strategy": "nope"})


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_trainer_errors_before_any_work(tmp_path):
    from kiln.utils.errors import KilnError

    with pytest.raises(ConfigError):
        Trainer(TinyRegressor(), {"learning_rat": 1})
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        Trainer("not a model", base_config(tmp_path))
    with pytest.raises(KilnError, match="needs a train_dataset"):
        Trainer(TinyRegressor(), base_config(tmp_path)).fit()


def test_iterable_dataset_without_max_steps_is_explained(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(regression_data(8))

    with pytest.raises(ValueError, match="set train.max_steps"):
        Trainer(TinyRegressor(), base_config(tmp_path), train_dataset=Stream()).fit()


def test_model_without_loss_is_explained(tmp_path):
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, y=None):
            return {"logits": self.lin(x)}

    with pytest.raises(ValueError, match="has no 'loss'"):
        Trainer(NoLoss(), base_config(tmp_path, max_steps=1), train_dataset=regression_data(8)).fit()


def test_bare_no_on_the_command_line_means_no():
    cfg = load_config(None, ["save.strategy=no", "eval_strategy=no", "logging_strategy=no"])
    assert cfg.save.strategy == cfg.eval.strategy == cfg.log.strategy == "no"


def test_docs_config_reference_is_current():
    """docs/config.md is generated; a new or changed option must be regenerated with `kiln config-docs`."""
    import pathlib

    from kiln.config.docs import config_markdown

    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == config_markdown(), "docs/config.md is stale: run `python -m kiln.docgen`"


def test_hf_arguments_kiln_lacks_are_accepted_while_off():
    """An HF TrainingArguments dump (every feature at its default) loads; hub settings without push_to_hub
    are dropped, and torchdynamo is the older name of torch_compile_backend."""
    cfg = load_config(
        {
            "jit_mode_eval": False,
            "use_ipex": False,
            "past_index": -1,
            "debug": "",
            "split_batches": None,
            "accelerator_config": None,
            "hub_model_id": "me/model",
            "hub_strategy": "every_save",
            "torchdynamo": "inductor",
        }
    )
    assert cfg.train.torch_compile_backend == "inductor"
