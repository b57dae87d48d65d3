"""Statements in README.md and docs/ that were once false, each checked against what the code does:
a Transformers causal LM trains and evaluates unchanged; docs/migration.md's refused options are
exactly kiln's refusal table; the precision plugins and strategies README names are the registry's and
the config's, and `--help` (docs/config.md) names them all; docs/distributed.md says what the exit test proves, no more."""

from __future__ import annotations

import re

import pytest
import torch

from kiln.config.hf import aliases
from kiln.precision import PRECISIONS
from tests.docs.blocks import REPO


def _text(page: str) -> str:
    return (REPO / page).read_text()


def test_readme_causal_lm_statement_holds(tmp_path):
    """README: "A Transformers model ... works unchanged: `Trainer(GPT2LMHeadModel(config), {...},
    train_dataset=...)`" -- training and evaluating a causal LM as given, nothing else passed."""
    transformers = pytest.importorskip("transformers")
    assert "works unchanged: `Trainer(GPT2LMHeadModel(config), {...}, train_dataset=...)`" in _text("README.md")
    from kiln import Trainer

    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (12, 16), generator=g)]
    trainer = Trainer(transformers.GPT2LMHeadModel(config),
                      {"output_dir": str(tmp_path), "max_steps": 2, "per_device_train_batch_size": 4,
                       "eval_strategy": "steps", "eval_steps": 2, "report_to": "none", "disable_tqdm": True},
                      train_dataset=rows, eval_dataset=rows[:4])
    out = trainer.fit()
    metrics = trainer.evaluate()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))


def _refused_table() -> set[str]:
    text = _text("docs/migration.md")
    lines = text[text.index("### Refused options"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = lines[start:next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))]
    rows = [line.split("|")[1] for line in table[2:]]  # the first column, below the header and its rule
    return {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}


def test_migration_refused_options_are_kiln_s_refusal_table():
    listed = _refused_table()
    assert listed, "docs/migration.md has no 'Refused options' table"
    assert listed == set(aliases.UNSUPPORTED), (
        f"docs/migration.md refuses {sorted(listed - set(aliases.UNSUPPORTED))} that kiln accepts, and omits "
        f"{sorted(set(aliases.UNSUPPORTED) - listed)} that kiln refuses")


@pytest.mark.parametrize("name, path", [("enable_jit_checkpoint", "save.on_preemption"),
                                        ("eval_use_gather_object", "eval.use_gather_object"),
                                        ("activation_checkpointing", "train.gradient_checkpointing")])
def test_options_once_listed_as_refused_are_accepted(name, path):
    from omegaconf import OmegaConf

    from kiln.config.load import load_config

    assert OmegaConf.select(load_config({name: True}), path) is True  # switched on, not refused


def _plugins() -> set[str]:
    """The registry's plugins by their own names (the other registered names are aliases of these)."""
    return {PRECISIONS.get(name).name for name in PRECISIONS.names()}


def test_readme_names_exactly_the_precision_plugins():
    match = re.search(r"a \*\*precision\*\* plugin \(([^)]*)\)", _text("README.md").replace("\n", " "))
    assert match, "README no longer lists the precision plugins"
    assert set(re.findall(r"`([^`]+)`", match.group(1))) == _plugins()


def test_help_and_config_reference_name_every_precision_plugin():
    from kiln.config.schema.precision import PrecisionConfig

    import dataclasses

    help_text = next(f for f in dataclasses.fields(PrecisionConfig) if f.name == "name").metadata["help"]
    row = next(line for line in _text("docs/config.md").splitlines() if line.startswith("| `precision.name` |"))
    for plugin in _plugins():
        assert re.search(rf"(^|[ ,]){re.escape(plugin)}([ ,.]|$)", help_text), f"kiln fit --help omits {plugin}"
        assert re.search(rf"[ ,]{re.escape(plugin)}[ ,.]", row), f"docs/config.md omits {plugin}"


def test_distributed_doc_says_what_the_exit_test_proves():
    text = _text("docs/distributed.md")
    section = text[text.index("## At exit"):text.index("## Performance")]
    test = _text("tests/distributed/test_exit_frees_groups.py")
    assert "tests/distributed/test_exit_frees_groups.py" in section
    # the two cases the test runs are the two the page claims
    assert '["hf_args", "own_destroy"]' in test
    assert "`TrainingArguments` created" in section and "`dist.destroy_process_group()` itself" in section
    # the fallback wait is the code's, and the page says no test covers it
    [wait] = re.findall(r"time\.sleep\(([\d.]+)\)  # something unknown holds a group", _text("kiln/strategies/process_group.py"))
    assert f"waits {wait} s" in section and "no test covers that fallback" in section


def test_readme_names_exactly_the_strategies_the_config_offers():
    """The strategy names `strategy.name`'s help lists (its aliases aside), all of them: README once left out
    `model_parallel`."""
    from dataclasses import fields

    from kiln.config.schema.strategy import StrategyConfig

    match = re.search(r"a \*\*strategy\*\* \(([^;)]*)", _text("README.md").replace("\n", " "))
    assert match, "README no longer lists the strategies"
    help_ = next(f.metadata["help"] for f in fields(StrategyConfig) if f.name == "name")
    offered = set(re.findall(r"[a-z_]+", help_.removesuffix(".").replace(" or ", ", "))) - {"or"}
    assert set(re.findall(r"`([^`]+)`", match.group(1))) == offered
