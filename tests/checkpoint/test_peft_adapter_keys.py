"""An adapter file (PEFT) with a key deleted must not load silently (issue 58, engine/model/peft.py): the
resume and the weights-only load both raise a CheckpointError naming the missing key, also when the
checkpoint's digests were rewritten to match (whoever edits the file can do that); an extra key is
named as well."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kiln import Trainer
from kiln.utils.errors import CheckpointError
from tests.checkpoint.planting import remark
from tests.distributed.worker_peft import data, lora_model
from tests.installed import requires

pytestmark = requires("peft")

CFG = {
    "max_steps": 2,
    "save_steps": 2,
    "per_device_train_batch_size": 4,
    "learning_rate": 0.05,
    "seed": 7,
    "report_to": "none",
    "disable_tqdm": True,
    "log": {"history": []},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("peft") / "run"
    Trainer(lora_model(), {**CFG, "output_dir": str(out)}, train_dataset=data()).fit()
    return out / "checkpoint-2"


def _edit_adapter(ckpt: Path, change) -> str:  # type: ignore[no-untyped-def]
    path = ckpt / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = sorted(tensors)[0]
    change(tensors, key)
    save_file(tensors, str(path), metadata={"format": "pt"})
    remark(ckpt)
    return key


@pytest.mark.parametrize(
    "edit, label",
    [
        (lambda tensors, key: tensors.pop(key), "missing keys"),
        (
            lambda tensors, key: tensors.update({key.replace("lora_A", "lora_C"): tensors[key].clone()}),
            "unexpected keys",
        ),
    ],
)
def test_an_adapter_file_whose_keys_do_not_match_is_refused(checkpoint, tmp_path, edit, label):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, ckpt)
    key = _edit_adapter(ckpt, edit)
    shown = key if label == "missing keys" else key.replace("lora_A", "lora_C")
    trainer = Trainer(
        lora_model(), {**CFG, "output_dir": str(tmp_path / "resumed"), "max_steps": 4}, train_dataset=data()
    )
    with pytest.raises(
        CheckpointError,
        match=rf"^The adapter in {ckpt} does not fit adapter 'default' of this model "
        rf"\({label}: .*{shown.replace('.', '[.]')}",
    ):
        trainer.fit(resume_from_checkpoint=str(ckpt))
    with pytest.raises(CheckpointError, match=label):
        trainer._load_from_checkpoint(str(ckpt))  # load_best_model_at_end, kiln evaluate/predict
    assert os.path.isdir(ckpt)


def test_many_foreign_keys_are_named_six_at_a_time(checkpoint, tmp_path):
    """The sentence names the first six keys (sorted) and counts the rest, so it stays one readable line."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, ckpt)
    path = ckpt / "adapter_model.safetensors"
    tensors = load_file(str(path))
    extra = {f"base_model.model.extra_{i}.lora_A.weight": tensors[sorted(tensors)[0]].clone() for i in range(8)}
    save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})
    remark(ckpt)
    trainer = Trainer(lora_model(), {**CFG, "output_dir": str(tmp_path / "resumed")}, train_dataset=data())
    with pytest.raises(CheckpointError) as err:
        trainer._load_from_checkpoint(str(ckpt))
    named = str(err.value).split("(unexpected keys: ", 1)[1].split(");", 1)[0]
    assert named == ", ".join(sorted(extra)[:6]) + " and 2 more"
