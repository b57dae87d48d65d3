"""What fit prints about the model when it starts: the one line, and on one process Lightning's
ModelSummary table below it (log.model_summary, log.model_summary_depth)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kiln import Trainer
from kiln.engine.model.summary import model_summary, model_table, start_summary
from tests.helpers import TinyRegressor, base_config, regression_data


def test_summary_counts_parameters_and_names_strategy_precision_and_processes(tmp_path):
    model = TinyRegressor()  # 8*16+16 + 16+16 + 16+1 = 193 parameters
    model.net[0].weight.requires_grad_(False)  # 128 frozen
    trainer = Trainer(model, base_config(tmp_path, precision="bf16-true", max_steps=1))
    assert model_summary(trainer.model, trainer.strategy, trainer.precision) == (
        "model TinyRegressor: 193 parameters (65 trainable, bfloat16); strategy single on cpu, 1 process; "
        "precision bf16-true (bfloat16 weights, bfloat16 compute)"
    )


def test_fit_prints_it_once_on_rank_zero(tmp_path, capsys):
    trainer = Trainer(
        TinyRegressor(), base_config(tmp_path, precision="bf16", max_steps=1), train_dataset=regression_data(8)
    )
    trainer.fit()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kiln: model ")]
    assert lines == [
        "kiln: model TinyRegressor: 193 parameters (193 trainable, float32); strategy single on cpu, 1 process; "
        "precision bf16 (float32 weights, bfloat16 compute)"
    ]
    quiet = Trainer(
        TinyRegressor(), base_config(tmp_path, max_steps=1, log_level="error"), train_dataset=regression_data(8)
    )
    quiet.fit()
    assert "kiln: model" not in capsys.readouterr().out


# -- the table (log.model_summary) -----------------------------------------------------------------
def _frozen_regressor() -> TinyRegressor:
    model = TinyRegressor()  # net: Linear(8, 16) 144, LayerNorm(16) 32, ReLU, Dropout, Linear(16, 1) 17
    model.net[0].weight.requires_grad_(False)  # 128 frozen
    return model


def test_the_table_lists_each_top_level_module_and_the_totals(tmp_path):
    trainer = Trainer(_frozen_regressor(), base_config(tmp_path, precision="bf16-true", max_steps=1))
    assert model_table(trainer.model, trainer.precision) == [  # bf16-true trains 2-byte weights
        "  | Name | Type       | Params | Trainable | Size",
        "--------------------------------------------------",
        "0 | net  | Sequential | 193    | 65        | 386 B",
        "--------------------------------------------------",
        "65        Trainable params",
        "128       Non-trainable params",
        "193       Total params",
        "386 B     Total estimated model params size",
    ]


def _rows(lines: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("|")][1:] for line in lines[2:] if " | " in line]


def test_depth_reaches_into_submodules_and_minus_one_lists_every_module(tmp_path):
    model, precision = _frozen_regressor(), SimpleNamespace(param_dtype=None)  # sizes in the parameters' own dtype
    assert _rows(model_table(model, precision, max_depth=2)) == [
        ["net", "Sequential", "193", "65", "772 B"],
        ["net.0", "Linear", "144", "16", "576 B"],
        ["net.1", "LayerNorm", "32", "32", "128 B"],
        ["net.2", "ReLU", "0", "0", "0 B"],
        ["net.3", "Dropout", "0", "0", "0 B"],
        ["net.4", "Linear", "17", "17", "68 B"],
    ]
    nested = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(1000, 1000))))
    assert [r[0] for r in _rows(model_table(nested, precision, max_depth=-1))] == ["0", "0.0", "0.0.0"]
    assert _rows(model_table(nested, precision, max_depth=0)) == []
    big = _rows(model_table(nested, precision, max_depth=1))
    assert big == [["0", "Sequential", "1.0M", "1.0M", "4.0 MB"]]


def test_a_shared_parameter_counts_once_in_the_totals():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    lines = model_table(Tied(), SimpleNamespace(param_dtype=None))
    assert _rows(lines) == [["emb", "Embedding", "40", "40", "160 B"], ["head", "Linear", "40", "40", "160 B"]]
    assert "40        Total params" in lines


def _summary_at_start(tmp_path, capsys, **config) -> list[str]:
    trainer = Trainer(TinyRegressor(), base_config(tmp_path, max_steps=1, **config), train_dataset=regression_data(8))
    trainer.fit()
    out = capsys.readouterr().out.splitlines()
    start = next((i for i, line in enumerate(out) if line.startswith("kiln: model ")), None)
    return [] if start is None else out[start : start + 9]


def test_fit_prints_the_table_on_one_process_and_as_configured(tmp_path, capsys):
    table = _summary_at_start(tmp_path / "a", capsys)
    assert table[0].startswith("kiln: model TinyRegressor: 193 parameters") and table[1].startswith("  | Name")
    assert (
        table[3].startswith("0 | net  | Sequential | 193") and table[8] == "772 B     Total estimated model params size"
    )
    assert _summary_at_start(tmp_path / "b", capsys, log={"model_summary": "table"})[:9] == table
    line = _summary_at_start(tmp_path / "c", capsys, log={"model_summary": "line"})
    assert line[0] == table[0] and not any(" | " in rest for rest in line[1:])
    assert _summary_at_start(tmp_path / "d", capsys, log={"model_summary": "off"}) == []
    deeper = _summary_at_start(tmp_path / "e", capsys, log={"model_summary_depth": 2})
    assert deeper[4].startswith("1 | net.0 | Linear")


def test_auto_prints_the_line_alone_with_several_processes():
    model, precision = TinyRegressor(), SimpleNamespace(name="fp32", param_dtype=None, compute_dtype=None)
    two = SimpleNamespace(name="ddp", root_device=torch.device("cpu"), world_size=2)
    assert start_summary(model, two, precision, "auto", 1) == f"kiln: {model_summary(model, two, precision)}"
    assert start_summary(model, two, precision, "table", 1).splitlines()[1].startswith("  | Name")
    one = SimpleNamespace(**{**vars(two), "world_size": 1, "name": "single"})
    assert start_summary(model, one, precision, "auto", 1).splitlines()[1].startswith("  | Name")
    assert start_summary(model, one, precision, "off", 1) is None


@pytest.mark.parametrize(
    "key, value, sentence",
    [
        ("model_summary", "full", "Config key 'log.model_summary' is 'full'; choose one of auto, table, line, off."),
        ("model_summary_depth", -2, "Config key 'log.model_summary_depth' must be -1 (every module) or >= 0, got -2."),
    ],
)
def test_a_bad_summary_setting_is_one_sentence(tmp_path, key, value, sentence):
    from kiln.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(base_config(tmp_path, log={key: value}))
    assert str(err.value) == sentence
    assert (
        load_config(
            base_config(tmp_path, log={"model_summary": "line", "model_summary_depth": -1})
        ).log.model_summary_depth
        == -1
    )
