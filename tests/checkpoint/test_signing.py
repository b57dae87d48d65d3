"""Signed checkpoints (`save.signing_key_env`), issue 52 item 4: COMPLETE carries an HMAC-SHA256 keyed
by the named environment variable, and resume (by `true` and by path), `kiln convert`, `kiln evaluate`
and `kiln predict` refuse a checkpoint whose signature does not verify: a forger who rewrites a file
and its digests, a stripped signature, another key, an unsigned checkpoint where a key is configured,
and a signed one where none is. The key never reaches a file or any output."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.engine.checkpoint.convert import convert_checkpoint
from kiln.engine.checkpoint.files import MARKER, why_damaged
from kiln.engine.checkpoint.resume import ResumeError, resolve_resume
from kiln.engine.checkpoint.signing import SigningKey, signing_key
from kiln.engine.checkpoint.weights import find_run_weights, given_weights
from kiln.utils.errors import CheckpointError, ConfigError
from tests.checkpoint.checkpoint_helpers import train, weights
from tests.checkpoint.planting import remark

ENV = "KILN_TEST_SIGNING_KEY"
SECRET = "s1gn-k3y-7f0c2e9a41"
KEY = SigningKey(ENV, SECRET.encode())
CFG = {"max_steps": 4, "save_steps": 2, "save": {"signing_key_env": ENV}}


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("signed") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, SECRET)
        trainer = train(str(out), CFG)
    return str(out), weights(trainer)


@pytest.fixture
def out(signed_run, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, SECRET)
    copy = str(tmp_path / "run")
    shutil.copytree(signed_run[0], copy)
    return copy


def forge(ckpt: str) -> None:
    """What a forger with write access does: other weights, and the sizes and digests rewritten to match."""
    path = os.path.join(ckpt, "model.safetensors")
    tensors = {k: torch.full_like(v, 0.25) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt", "kiln_aliases": "{}"})
    remark(Path(ckpt))


def test_the_marker_is_signed_and_verifies(out):
    ckpt = os.path.join(out, "checkpoint-4")
    signature = json.loads(open(os.path.join(ckpt, MARKER)).read())["signature"]
    assert signature["scheme"] == "hmac-sha256" and signature["key_env"] == ENV and len(signature["hmac"]) == 64
    assert why_damaged(ckpt, KEY) is None
    assert resolve_resume(ckpt, out, KEY) == ckpt and resolve_resume(True, out, KEY) == ckpt


def test_kiln_convert_verifies_with_the_named_key_and_says_how_it_is_used(out, tmp_path, capsys):
    from kiln.cli import main

    ckpt, export = os.path.join(out, "checkpoint-4"), str(tmp_path / "export")
    assert main(["convert", ckpt, export, "--signing-key-env", ENV]) == 0
    assert capsys.readouterr().out.strip() == os.path.join(export, "model.safetensors")
    exported = load_file(os.path.join(export, "model.safetensors"))
    assert exported.keys() == load_file(os.path.join(ckpt, "model.safetensors")).keys()
    for bad in ([ckpt], [ckpt, export, "--signing-key-env"], [ckpt, export, "--signing-key", ENV], ["-h", export]):
        assert main(["convert", *bad]) == 2
        assert capsys.readouterr().err == "usage: kiln convert CHECKPOINT OUT [--signing-key-env NAME]\n"


def test_a_forged_checkpoint_is_refused_by_resume_convert_evaluate_and_predict(signed_run, out, tmp_path, capsys):
    from kiln.cli import main

    ckpt = os.path.join(out, "checkpoint-4")
    forge(ckpt)
    assert why_damaged(ckpt) is not None  # without the key: signed, so refused too
    reason = f"its signature does not verify with the key in {ENV}"
    with pytest.raises(ResumeError, match=reason):
        resolve_resume(ckpt, out, KEY)
    with pytest.raises(CheckpointError, match=reason):
        convert_checkpoint(ckpt, str(tmp_path / "export"), KEY)
    assert main(["convert", ckpt, str(tmp_path / "export"), "--signing-key-env", ENV]) == 1
    assert reason in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=reason):  # kiln evaluate / kiln predict --weights
        given_weights(ckpt, KEY)
    with pytest.raises(CheckpointError, match=reason):  # kiln evaluate / kiln predict picking the run's weights
        find_run_weights(out, KEY)
    with pytest.warns(UserWarning, match=rf"Ignoring damaged checkpoint .*checkpoint-4: {reason}"):
        resumed = train(out, CFG, resume=True)  # from checkpoint-2, exactly: none of the forged weights
    assert all(torch.equal(weights(resumed)[k], v) for k, v in signed_run[1].items())


def test_a_stripped_signature_is_refused_when_a_key_is_configured(out, tmp_path):
    ckpt = os.path.join(out, "checkpoint-4")
    forge(ckpt)
    meta = json.loads(open(os.path.join(ckpt, MARKER)).read())
    del meta["signature"]
    open(os.path.join(ckpt, MARKER), "w").write(json.dumps(meta))
    reason = f"it is not signed, and this run requires checkpoints signed with the key in {ENV}"
    with pytest.raises(ResumeError, match=reason):
        resolve_resume(ckpt, out, KEY)
    with pytest.raises(CheckpointError, match=reason):
        convert_checkpoint(ckpt, str(tmp_path / "export"), KEY)
    with pytest.raises(CheckpointError, match=reason):
        given_weights(ckpt, KEY)


def test_the_signature_does_not_depend_on_the_order_of_the_markers_keys(out):
    """A tool that rewrites the marker's JSON with its keys in another order changes nothing signed."""
    ckpt = os.path.join(out, "checkpoint-4")
    meta = json.loads(open(os.path.join(ckpt, MARKER)).read())
    reordered = {k: (dict(reversed(v.items())) if isinstance(v, dict) else v) for k, v in reversed(meta.items())}
    assert list(reordered) != list(meta)
    open(os.path.join(ckpt, MARKER), "w").write(json.dumps(reordered))
    assert why_damaged(ckpt, KEY) is None


def test_another_key_is_refused(out):
    ckpt = os.path.join(out, "checkpoint-4")
    with pytest.raises(ResumeError, match="signature does not verify .*signed with another key"):
        resolve_resume(ckpt, out, SigningKey(ENV, b"another key"))


def test_a_signed_checkpoint_without_a_key_is_refused_naming_the_variable(out, tmp_path):
    ckpt = os.path.join(out, "checkpoint-4")
    reason = (
        rf"it is signed \(with the key in {ENV}\) but this run has no signing key to verify it: set "
        rf"save.signing_key_env to {ENV} \(kiln convert: --signing-key-env {ENV}\)"
    )
    with pytest.raises(ResumeError, match=reason):
        resolve_resume(ckpt, out)
    with pytest.raises(CheckpointError, match=reason):
        convert_checkpoint(ckpt, str(tmp_path / "export"))
    with pytest.raises(CheckpointError, match=reason):
        given_weights(ckpt)
    assert os.path.exists(convert_checkpoint(ckpt, str(tmp_path / "export"), KEY))  # with the key it converts


def test_unsigned_checkpoints_and_exports_are_refused_when_a_key_is_configured(tmp_path, monkeypatch):
    out = str(tmp_path / "plain")
    train(out, {"max_steps": 2, "save_steps": 2}).save_model()  # no key: unsigned checkpoint-2, and an export
    ckpt = os.path.join(out, "checkpoint-2")
    assert resolve_resume(ckpt, out) == ckpt and given_weights(out).origin == "given weights"
    with pytest.raises(ResumeError, match="it is not signed"):
        resolve_resume(ckpt, out, KEY)
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint .*it is not signed"):
        with pytest.raises(ResumeError, match="No valid checkpoint found"):
            resolve_resume(True, out, KEY)
    with pytest.raises(CheckpointError, match=f"has no COMPLETE marker, so it carries no signature.*{ENV}"):
        given_weights(out, KEY)  # a save_model folder: nothing to verify
    assert find_run_weights(out).origin == "exported model"
    with pytest.raises(CheckpointError, match="the last checkpoint .* it is not signed"):
        find_run_weights(out, KEY)  # the export is passed over; the unsigned checkpoint refused


def test_an_hf_checkpoint_is_unsigned(out):
    ckpt = os.path.join(out, "checkpoint-4")
    for name in ("COMPLETE", "config.yaml", "loop_state_0.pt", "kiln_loop_position.json", "precision.pt"):
        os.remove(os.path.join(ckpt, name))
    path = os.path.join(ckpt, "model.safetensors")
    save_file(load_file(path), path, metadata={"format": "pt"})
    assert resolve_resume(ckpt, out) == ckpt
    with pytest.raises(ResumeError, match="written by HF's Trainer and is not signed"):
        resolve_resume(ckpt, out, KEY)


def test_the_key_must_be_set_and_never_shows(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError, match=f"save.signing_key_env is {ENV}, but that environment variable is not set"):
        train(str(tmp_path / "unset"), CFG)
    assert signing_key(None) is None
    monkeypatch.setenv(ENV, SECRET)
    key = signing_key(ENV)
    assert key == KEY and SECRET not in repr(key) and SECRET not in str(key)
    out = tmp_path / "run"
    trainer = train(str(out), CFG, resume=None)
    trainer.save_model()
    train(str(out), {**CFG, "max_steps": 6}, resume=True)
    seen = capsys.readouterr()
    assert SECRET not in seen.out + seen.err + caplog.text
    for path in out.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
