"""Checkpoints written before fsdp and model_parallel became presets of one mesh strategy stay readable
and resumable (issue 53): `legacy/` holds a 2-process checkpoint of each old format, written by the kiln
of commit 72e154f (make_legacy_checkpoints.py, which says how) -- "fsdp-sharded" from `strategy: fsdp`
and "model-parallel-dcp" from `strategy: model_parallel` with tp 2 -- at step 2 of 4, beside the weights
and losses of the run that never stopped.

Each is resumed on one process under BOTH presets (DCP reshards either on load, whatever mesh saved it):
the weights loaded are the saved ones bit for bit (what `kiln convert` reads from the folder), and the
continued run ends within 1e-5 of the uninterrupted one, with its logged losses (the optimizer state
and the schedule came back too: AdamW without its moments would step elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.engine.checkpoint.convert import convert_checkpoint
from tests.strategies.mesh.make_legacy_checkpoints import config, trainer

LEGACY = Path(__file__).resolve().parent / "legacy"
#: old format -> the DCP folder it wrote
FOLDERS = {"fsdp-sharded": "fsdp_dcp", "model-parallel-dcp": "model_parallel_dcp"}
PRESETS = {
    "fsdp": {"name": "fsdp", "device": "cpu", "wrap": ["Block"]},
    "model_parallel": {"name": "model_parallel", "device": "cpu", "wrap": ["Block"]},
}


def _checkpoint(fmt: str) -> Path:
    ckpt = LEGACY / fmt / "checkpoint-2"
    marker = json.loads((ckpt / "COMPLETE").read_text())
    assert (marker["format"], marker["world_size"]) == (fmt, 2) and (ckpt / FOLDERS[fmt]).is_dir()
    return ckpt


def _resume(fmt: str, preset: str, out: Path, max_steps: int) -> tuple[dict, list]:
    cfg = config(
        fmt,
        str(out),
        strategy=PRESETS[preset],
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save={"strategy": "no"},
        resume_from_checkpoint=str(_checkpoint(fmt)),
    )
    with pytest.warns(UserWarning, match="was saved by 2 processes and this run has 1"), trainer(cfg) as t:
        t.fit()
        weights = {k: v.detach().float().clone() for k, v in t.strategy.model_state_for_export(t.model).items()}
        return weights, [h["loss"] for h in t.state.log_history if "loss" in h]


@pytest.mark.parametrize("fmt", FOLDERS)
def test_an_old_checkpoint_loads_bit_for_bit_and_converts(fmt, tmp_path):
    converted = load_file(convert_checkpoint(str(_checkpoint(fmt)), str(tmp_path / "converted")))
    loaded, losses = _resume(fmt, "fsdp", tmp_path / "at", max_steps=2)  # stops where it loaded
    assert losses == json.loads((LEGACY / fmt / "losses.json").read_text())[:2]  # the restored log history
    assert set(loaded) == set(converted)
    for name, value in converted.items():
        assert torch.equal(loaded[name], value.float()), name


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fmt", FOLDERS)
def test_an_old_checkpoint_resumes_under_both_presets(fmt, preset, tmp_path):
    weights, losses = _resume(fmt, preset, tmp_path / "run", max_steps=4)
    final = load_file(str(LEGACY / fmt / "final.safetensors"))
    old_losses = json.loads((LEGACY / fmt / "losses.json").read_text())
    assert set(weights) == set(final)
    for name, value in final.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert losses[:2] == old_losses[:2]  # restored with the trainer state
    assert losses[2:] == pytest.approx(old_losses[2:], rel=1e-5)  # steps 3 and 4, trained again
