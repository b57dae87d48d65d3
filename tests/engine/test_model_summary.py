"""The one-line summary printed when training starts."""

from __future__ import annotations


from kiln import Trainer
from kiln.engine.model.summary import model_summary
from tests.helpers import TinyRegressor, base_config, regression_data


def test_summary_counts_parameters_and_names_strategy_precision_and_processes(tmp_path):
    model = TinyRegressor()  # 8*16+16 + 16+16 + 16+1 = 193 parameters
    model.net[0].weight.requires_grad_(False)  # 128 frozen
    trainer = Trainer(model, base_config(tmp_path, precision="bf16-true", max_steps=1))
    assert model_summary(trainer.model, trainer.strategy, trainer.precision) == (
        "model TinyRegressor: 193 parameters (65 trainable, bfloat16); strategy single on cpu, 1 process; "
        "precision bf16-true (bfloat16 weights, bfloat16 compute)")


def test_fit_prints_it_once_on_rank_zero(tmp_path, capsys):
    trainer = Trainer(TinyRegressor(), base_config(tmp_path, precision="bf16", max_steps=1), train_dataset=regression_data(8))
    trainer.fit()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kiln: model ")]
    assert lines == ["kiln: model TinyRegressor: 193 parameters (193 trainable, float32); strategy single on cpu, 1 process; "
                     "precision bf16 (float32 weights, bfloat16 compute)"]
    quiet = Trainer(TinyRegressor(), base_config(tmp_path, max_steps=1, log_level="error"), train_dataset=regression_data(8))
    quiet.fit()
    assert "kiln: model" not in capsys.readouterr().out
