"""FSDP checkpoints: an interrupted run resumed from a sharded or full checkpoint ends bitwise where
the uninterrupted one does; a 2-process sharded checkpoint resumes on 1 process and a 1-process one
on 2 (DCP reshards); `kiln convert` turns a sharded checkpoint into one model.safetensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.strategies.fsdp.conftest import torchrun

pytestmark = pytest.mark.distributed


def _equal(a: dict, b: dict, tol: float = 0.0) -> None:
    assert set(a) == set(b) and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m, n=k: f"{n}: {m}")


KINDS = ("sharded", "full")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """kind -> the folder of one uninterrupted 2-process run (checkpoints at steps 2, 4, 6), both kinds made
    in one world once for the module: the resume and reshard tests read the same runs (each 2-process job
    costs seconds of starts)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    torchrun(2, "worker_resume.py", *_joined([root / kind, kind] for kind in KINDS))
    return lambda kind: root / kind


@pytest.fixture(scope="module")
def resumed(uninterrupted, tmp_path_factory):
    """kind -> the folder of a run resumed from the uninterrupted run's checkpoint-2 to step 6: a second
    world (a fresh process, as after a kill), both kinds in it."""
    root = tmp_path_factory.mktemp("resumed")
    runs = ([root / kind, kind, uninterrupted(kind) / "full_shard" / "checkpoint-2", 6] for kind in KINDS)
    torchrun(2, "worker_resume.py", *_joined(runs))
    return lambda kind: root / kind


def _joined(runs) -> list:
    """worker_resume.py's arguments for several runs in one world."""
    out: list = []
    for spec in runs:
        out += ["+", *spec] if out else spec
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_resume_is_exact(kind, uninterrupted, resumed):
    first, second = uninterrupted(kind), resumed(kind)
    ckpt = first / "full_shard" / "checkpoint-2"
    marker = json.loads((ckpt / "COMPLETE").read_text())
    assert marker["format"] == f"fsdp-{kind}" and marker["world_size"] == 2
    if kind == "sharded":  # every rank wrote its own shard
        assert {f for f in os.listdir(ckpt / "fsdp_dcp") if f.endswith(".distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    else:
        assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.pt").exists()
    _equal(load_file(str(second / "final.safetensors")), load_file(str(first / "final.safetensors")))


@pytest.mark.heavy  # test_resume_is_exact[full] and the model_parallel tp resume tests cover its halves
def test_a_full_checkpoint_of_a_tensor_parallel_mesh_holds_whole_weights_and_resumes_exactly(tmp_path):
    """state_dict_type full under model_parallel's tp 2: the TP splits are gathered into whole weights
    (the plain module's shapes) and put back as splits on resume."""
    from tests.strategies.fsdp.cases import TinyLM

    first, second = tmp_path / "first", tmp_path / "second"
    torchrun(2, "worker_resume.py", first, "full", env={"KILN_TEST_TP": "1"})
    ckpt = first / "full_shard" / "checkpoint-2"
    assert json.loads((ckpt / "COMPLETE").read_text())["format"] == "fsdp-full"
    assert "name: model_parallel" in (ckpt / "config.yaml").read_text()
    saved = load_file(str(ckpt / "model.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in TinyLM().state_dict().items()}
    torchrun(2, "worker_resume.py", second, "full", ckpt, 6, env={"KILN_TEST_TP": "1"})
    _equal(load_file(str(second / "final.safetensors")), load_file(str(first / "final.safetensors")))


# CI time: the layout translation (kiln.utils.param_groups) is shared by every format and tested in one process
# (tests/checkpoint/test_param_group_layout.py), the sharded load path by test_resume_is_exact[sharded]
@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_checkpoints_resume_across_param_group_layouts(tmp_path, kind):
    """kiln.utils.param_groups: older kiln kept one optimizer group without weight decay; today's two (HF's)."""
    one, two, decay = tmp_path / "one_group", tmp_path / "two_groups", tmp_path / "decay"
    torchrun(2, "worker_resume.py", one, kind, env={"KILN_TEST_ONE_GROUP": "1"})
    # saved in one group, resumed in two: ends where the uninterrupted run does
    torchrun(2, "worker_resume.py", two, kind, one / "full_shard" / "checkpoint-2", 6)
    _equal(load_file(str(two / "final.safetensors")), load_file(str(one / "final.safetensors")))
    # saved in one group, resumed with weight decay set: the saved settings, no decay, win
    torchrun(
        2,
        "worker_resume.py",
        decay,
        kind,
        one / "full_shard" / "checkpoint-4",
        6,
        env={"KILN_TEST_WEIGHT_DECAY": "0.01"},
    )
    _equal(load_file(str(decay / "final.safetensors")), load_file(str(one / "final.safetensors")))


# CI time: fsdp is a preset of the mesh strategy, whose one DCP checkpoint IO model_parallel's tests reshard
# between process counts in the default run (tp 2 -> one process -> tp 2, test_model_parallel.py)
@pytest.mark.heavy
def test_sharded_checkpoint_reshards_between_process_counts(tmp_path, uninterrupted):
    from kiln.strategies.mesh.checkpoint_io import ShardedCheckpointIO

    two, one = uninterrupted("sharded"), tmp_path / "one"
    torchrun(1, "worker_resume.py", one, "sharded")
    # 2 -> 1: loading alone restores the saved weights exactly; training on reaches the 2-process result
    ckpt2 = two / "full_shard" / "checkpoint-4"
    torchrun(1, "worker_resume.py", tmp_path / "2to1_load", "sharded", ckpt2, 4)
    _equal(
        load_file(str(tmp_path / "2to1_load" / "final.safetensors")),
        {k: v.float() for k, v in ShardedCheckpointIO.consolidate(str(ckpt2)).items()},
    )
    torchrun(1, "worker_resume.py", tmp_path / "2to1", "sharded", ckpt2, 6)
    _equal(load_file(str(tmp_path / "2to1" / "final.safetensors")), load_file(str(two / "final.safetensors")), 1e-5)
    # 1 -> 2
    ckpt1 = one / "full_shard" / "checkpoint-4"
    torchrun(2, "worker_resume.py", tmp_path / "1to2", "sharded", ckpt1, 6)
    _equal(load_file(str(tmp_path / "1to2" / "final.safetensors")), load_file(str(one / "final.safetensors")), 1e-5)


# CI time: tests/strategies/export/test_tied_export.py (every strategy's export of a tied model, both loaders)
# and tests/checkpoint/test_convert_loadable.py (convert of a sharded checkpoint) cover its halves
@pytest.mark.heavy
def test_tied_gpt2_keeps_its_tie_through_training_checkpoint_export_and_convert(tmp_path):
    from transformers import GPT2LMHeadModel

    from tests.distributed.conftest import kiln_cli

    torchrun(2, "worker_gpt2.py", tmp_path, timeout=900)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"tied_after_training": True, "step": 4}
    live = load_file(str(tmp_path / "live.safetensors"))
    # export: from_pretrained works, the tie holds, the weights are the trained ones
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "export"))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    state = loaded.state_dict()
    for name, value in live.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    # convert: the sharded last checkpoint becomes one file holding the same weights, in this process
    kiln_cli("convert", tmp_path / "run" / "checkpoint-4", tmp_path / "converted")
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    plain = GPT2LMHeadModel(loaded.config)
    missing, unexpected = plain.load_state_dict(converted, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    plain.tie_weights()
    assert plain.lm_head.weight.data_ptr() == plain.transformer.wte.weight.data_ptr()
    for name, value in live.items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_convert_refuses_a_folder_without_marker(tmp_path, capsys):
    from kiln.cli import main  # in this process (the CLI process exits 1 on a refusal: test_planted_payloads.py)

    assert main(["convert", str(tmp_path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "COMPLETE" in err
