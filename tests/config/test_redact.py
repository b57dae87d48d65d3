"""Values from `${oc.env:VAR}` reach training but never a file kiln writes or a tracker: saved configs
and logged hyperparameters keep the interpolation instead (issue 34, item 9)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln import Trainer
from kiln.config import load_config
from kiln.config.redact import config_for_saving
from kiln.utils.errors import ConfigError
from tests.helpers import TinyRegressor, regression_data

SECRET = "tok-9f3a7c1e5b"
OTHER = "pw-77d1e0a4"


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    monkeypatch.setenv("OTHER_SECRET", OTHER)


def _yaml(tmp_path: Path, **extra: str) -> Path:
    lines = [
        f"output_dir: {tmp_path / 'out'}",
        "run_name: ${oc.env:SECRET_TOKEN}",
        "max_steps: 2",
        "save_steps: 1",
        "logging_steps: 1",
        "strategy: {device: cpu}",
        "log: {disable_tqdm: true}",
    ]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path = tmp_path / "cfg.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _files_holding(root: Path, *values: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.relative_to(root)} holds {v!r}" for v in values if v.encode() in data]
    return found


def test_training_sees_the_value_saving_sees_the_interpolation(tmp_path: Path, secrets: None) -> None:
    cfg = load_config(
        _yaml(tmp_path),
        [
            "task.model_args={token: '${oc.env:OTHER_SECRET}'}",
            "eval.generation_kwargs={auth: 'Bearer ${oc.env:OTHER_SECRET}'}",
        ],
    )
    assert cfg.run_name == SECRET and cfg.task.model_args.token == OTHER  # training reads the real values
    saved = config_for_saving(cfg)
    assert saved["run_name"] == "${oc.env:SECRET_TOKEN}"
    assert saved["task"]["model_args"]["token"] == "${oc.env:OTHER_SECRET}"
    assert saved["eval"]["generation_kwargs"]["auth"] == "Bearer ${oc.env:OTHER_SECRET}"  # inside a longer string too
    assert SECRET not in str(saved) and OTHER not in str(saved)


def test_short_env_values_are_masked_only_where_they_are_the_whole_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_TEST_TWO", "2")
    cfg = load_config({"output_dir": str(tmp_path / "run2"), "run_name": "${oc.env:KILN_TEST_TWO}"})
    saved = config_for_saving(cfg)
    assert saved["run_name"] == "${oc.env:KILN_TEST_TWO}" and saved["output_dir"].endswith("run2")


def test_unset_variable_is_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SECRET_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"'run_name' from the environment variable SECRET_TOKEN, which is not set"):
        load_config(_yaml(tmp_path))
    with pytest.raises(ConfigError, match=r"'hub_token' from the environment variable SECRET_TOKEN"):
        load_config(None, ["hub_token=${oc.env:SECRET_TOKEN}"])


def test_trackers_never_get_the_value(tmp_path: Path, secrets: None) -> None:
    """TensorBoard's hparams and the csv/jsonl history: the logger path (kiln/loggers)."""
    path = _yaml(tmp_path, report_to="[tensorboard, csv, jsonl]", save_strategy="'no'")
    trainer = Trainer(
        TinyRegressor(), str(path), overrides=["hub_token=${oc.env:OTHER_SECRET}"], train_dataset=regression_data(16)
    )
    assert trainer.config.run_name == SECRET
    trainer.fit()
    runs = tmp_path / "out" / "runs"
    assert any(runs.rglob("events.out.tfevents.*"))
    assert _files_holding(runs, SECRET, OTHER) == []


def test_no_file_under_output_dir_holds_the_value(tmp_path: Path, secrets: None) -> None:
    """Checkpoints' config.yaml and the exported kiln_config.yaml too (kiln/engine/checkpoint)."""
    path = _yaml(tmp_path, report_to="[tensorboard, csv, jsonl]")
    trainer = Trainer(
        TinyRegressor(), str(path), overrides=["hub_token=${oc.env:OTHER_SECRET}"], train_dataset=regression_data(16)
    )
    trainer.fit()
    trainer.save_model()
    out = tmp_path / "out"
    assert (out / "checkpoint-2" / "config.yaml").exists() and (out / "kiln_config.yaml").exists()
    assert _files_holding(out, SECRET, OTHER) == []
    assert "${oc.env:SECRET_TOKEN}" in (out / "kiln_config.yaml").read_text()
    assert os.environ["SECRET_TOKEN"] == SECRET


def test_tracker_run_names_are_masked_too(tmp_path: Path, secrets: None) -> None:
    """W&B and MLflow name their runs after run_name."""
    from kiln.loggers.base import run_name

    cfg = load_config(_yaml(tmp_path))
    assert cfg.run_name == SECRET and run_name(cfg) == "${oc.env:SECRET_TOKEN}"


def test_substring_masking_starts_at_six_characters_and_prefers_the_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.config.redact import mask

    monkeypatch.setenv("KILN_T5", "q5w4e")
    monkeypatch.setenv("KILN_T6", "z6x5c4")
    monkeypatch.setenv("KILN_SHORT", "m0n1b2v3")
    monkeypatch.setenv("KILN_LONG", "m0n1b2v3-ext")
    load_config(None, ["run_name=${oc.env:KILN_T5}/${oc.env:KILN_T6}/${oc.env:KILN_SHORT}/${oc.env:KILN_LONG}"])
    assert mask("a-q5w4e-b") == "a-q5w4e-b" and mask("q5w4e") == "${oc.env:KILN_T5}"  # 5: whole values only
    assert mask("a-z6x5c4-b") == "a-${oc.env:KILN_T6}-b"  # 6: inside strings too
    assert mask("url/m0n1b2v3-ext") == "url/${oc.env:KILN_LONG}"  # not "${oc.env:KILN_SHORT}-ext"


def test_interpolations_of_other_keys_are_saved_resolved() -> None:
    """Only values from the environment read `${oc.env:...}` again; `${train.learning_rate}` is saved as the
    value it stood for, so a saved config reads the same without the config it came from."""
    from omegaconf import OmegaConf

    config = OmegaConf.create({"train": {"learning_rate": 0.25}, "optim": {"lr": "${train.learning_rate}"}})
    assert config_for_saving(config) == {"train": {"learning_rate": 0.25}, "optim": {"lr": 0.25}}
