"""A checkpoint's config.yaml is data (issue 52, item 5): an `${oc.env:AWS_SECRET_ACCESS_KEY}` planted in
it is never resolved, so the secret reaches no warning, log, output or file on resume; a typed value
error names the key and the variable, never the value. And a secret inside a config *list* is masked
in every file kiln saves (issue 58, config/redact.py)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import yaml

from kiln.config import load_config
from kiln.engine.checkpoint.saved_config import changed_settings
from kiln.engine.loop.batch_size import saved_batch_size
from kiln.utils.errors import ConfigError
from tests.checkpoint.checkpoint_helpers import train
from tests.checkpoint.planting import remark

AWS = "AWS_SECRET_ACCESS_KEY"
PLANTED = "${oc.env:" + AWS + "}"


def _holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("secrets") / "run"
    train(str(out), {"max_steps": 4, "save_steps": 2})
    return out


@pytest.fixture
def planted(run, tmp_path, monkeypatch):
    """checkpoint-2 whose config.yaml reads the secret in the keys the resume compares (digests rewritten:
    whoever plants it controls the folder)."""
    secret = "AKIAsecret-1b9e7d55c3"
    monkeypatch.setenv(AWS, secret)
    out = tmp_path / "run"
    shutil.copytree(run, out)
    shutil.rmtree(out / "checkpoint-4")
    ckpt = out / "checkpoint-2"
    tree = yaml.safe_load((ckpt / "config.yaml").read_text())
    tree["seed"] = PLANTED
    tree["data"]["per_device_train_batch_size"] = PLANTED
    tree["train"]["gradient_accumulation_steps"] = f"prefix-{PLANTED}"
    (ckpt / "config.yaml").write_text(yaml.safe_dump(tree))
    remark(ckpt)
    return out, ckpt, secret


def test_a_planted_interpolation_is_never_resolved_on_resume(planted, capsys, caplog, recwarn):
    out, ckpt, secret = planted
    with caplog.at_level(logging.DEBUG):
        with pytest.warns(UserWarning, match="changed settings") as seen:
            train(str(out), {"max_steps": 4, "save_steps": 2}, resume=str(ckpt))
    text = " ".join(str(w.message) for w in [*seen, *recwarn]) + caplog.text + "".join(capsys.readouterr())
    assert f"seed '{PLANTED}' -> 7" in text  # compared as the text the file holds
    assert secret not in text
    assert _holding(out, secret) == []


def test_the_comparison_and_the_saved_batch_size_read_text_only(planted):
    _, ckpt, secret = planted
    moved = changed_settings(
        str(ckpt), {"seed": 7, "data": {"per_device_train_batch_size": 4}}, ("seed", "data.per_device_train_batch_size")
    )
    assert moved == [f"seed '{PLANTED}' -> 7", f"data.per_device_train_batch_size '{PLANTED}' -> 4"]
    assert secret not in str(moved)
    assert saved_batch_size(str(ckpt)) is None  # not numbers: auto_find_batch_size searches again


def test_an_unchanged_config_warns_about_nothing(run):
    ckpt = str(run / "checkpoint-2")
    saved = yaml.safe_load(open(os.path.join(ckpt, "config.yaml")).read())
    assert changed_settings(ckpt, saved, ("seed", "data.per_device_train_batch_size")) == []
    assert changed_settings(ckpt, {**saved, "seed": 7.0}, ("seed",)) == []  # 7 and 7.0 are one setting
    assert saved_batch_size(ckpt) == (4, 1)


@pytest.mark.parametrize("source", ["yaml", "mapping"])
def test_a_typed_value_error_names_the_key_and_variable_never_the_value(tmp_path, monkeypatch, source):
    secret = f"not-a-number-{source}-5e1f0a"
    monkeypatch.setenv("KILN_TEST_LR_SECRET", secret)
    raw = {"learning_rate": "${oc.env:KILN_TEST_LR_SECRET}"}
    if source == "yaml":
        path = tmp_path / "cfg.yaml"
        path.write_text("learning_rate: ${oc.env:KILN_TEST_LR_SECRET}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path) if source == "yaml" else raw)
    message = str(err.value)
    assert message == (
        "Config key 'optim.lr' expects float, but it is set from ${oc.env:KILN_TEST_LR_SECRET}, whose "
        "value is not one (the value is not shown)."
    )
    assert secret not in message


def test_other_config_errors_show_the_variable_not_the_value(monkeypatch):
    secret = "strategy-secret-83c2d1"
    monkeypatch.setenv("KILN_TEST_STRATEGY_SECRET", secret)
    with pytest.raises(ConfigError) as err:
        load_config({"strategy": "${oc.env:KILN_TEST_STRATEGY_SECRET}"})
    assert "${oc.env:KILN_TEST_STRATEGY_SECRET}" in str(err.value) and secret not in str(err.value)


def test_a_secret_inside_a_config_list_is_masked_in_every_saved_file(tmp_path, monkeypatch):
    secret = "list-held-token-4d7b0e"  # unique: masks are remembered per process
    monkeypatch.setenv("KILN_TEST_LIST_SECRET", secret)
    out = tmp_path / "run"
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "task:\n  model_args:\n    headers: [plain, '${oc.env:KILN_TEST_LIST_SECRET}', "
        "'Bearer ${oc.env:KILN_TEST_LIST_SECRET}']\n"
    )
    cfg = load_config(str(path))
    assert list(cfg.task.model_args.headers) == ["plain", secret, f"Bearer {secret}"]  # training sees the value
    raw = yaml.safe_load(path.read_text())["task"]
    trainer = train(str(out), {"max_steps": 2, "save_steps": 2, "task": raw})
    assert trainer.config.task.model_args.headers[1] == secret
    trainer.save_model()
    assert (out / "checkpoint-2" / "config.yaml").exists() and (out / "kiln_config.yaml").exists()
    assert _holding(out, secret) == []
    saved = yaml.safe_load((out / "checkpoint-2" / "config.yaml").read_text())
    assert saved["task"]["model_args"]["headers"] == [
        "plain",
        "${oc.env:KILN_TEST_LIST_SECRET}",
        "Bearer ${oc.env:KILN_TEST_LIST_SECRET}",
    ]
