"""Issue 34: loading a checkpoint never runs code from it, in any format kiln writes.

A `__reduce__` payload (it would create a marker file: a stand-in for any code) is planted in every
pickle-bearing file of a real checkpoint of each format: single (optimizer, scheduler, RNG, loop and
precision state), DDP, FSDP full and sharded (the DCP `.metadata`, a non-tensor entry and a tensor entry
of a `.distcp` file), DeepSpeed ZeRO 0-3 (every `.pt` under `ds/`). The planted files are otherwise
intact and the COMPLETE marker is rewritten to match, as an attacker controlling the folder would. Resuming
and `kiln convert` must both raise CheckpointError with one clear sentence, and the marker never appears.
FSDP and DDP run on 2 processes, DeepSpeed on 1 (gloo on CPU); each family is one launch that saves,
plants (tests/checkpoint/planting.py) and resumes, whatever the number of cases."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln import cli
from kiln.engine.checkpoint.convert import convert_checkpoint
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import train
from tests.checkpoint.planting import DS_FORMATS, FSDP_CASES, plant
from tests.world import run_world

HERE = Path(__file__).resolve().parent
WORKER = HERE / "payload_worker.py"


def _launch(nproc: int, out: Path, family: str) -> None:
    run_world(WORKER, out, family, nproc=nproc, timeout=900, env={"DS_ACCELERATOR": "cpu"})


def _family(tmp_path_factory, family: str, nproc: int) -> tuple[Path, list[str], dict, list[dict]]:
    """One launch: save, plant (rank 0), resume every planted case (payload_worker.py)."""
    out = tmp_path_factory.mktemp(f"payload_{family}")
    _launch(nproc, out, family)
    markers = json.loads((out / "markers.json").read_text())
    results = [json.loads((out / f"resumed_{r}.json").read_text()) for r in range(nproc)]
    return out, list(markers), markers, results


@pytest.fixture(scope="module")
def fsdp_family(tmp_path_factory):
    family = _family(tmp_path_factory, "fsdp", 2)
    assert family[1] == FSDP_CASES
    return family


@pytest.fixture(scope="module")
def ds_family(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _family(tmp_path_factory, "ds", 1)


def _refused(message: str | None, marker: str) -> None:
    assert not os.path.exists(marker), "the planted payload ran"
    assert message is not None, "the planted checkpoint was resumed as if it were clean"
    assert message.startswith("CheckpointError: Refusing to load "), message
    assert "never executes code from a checkpoint" in message, message
    assert "weights_only=False" not in message and "safe_globals" not in message, message  # no advice to load it anyway
    assert message.count("\n") == 0, message


def _check_family(family) -> None:
    out, cases, markers, results = family
    assert cases
    for case in cases:
        for rank_results in results:  # every rank refuses, so none waits in a collective
            _refused(rank_results[case], markers[case]["resume"])


def _check_convert(family, capfd) -> None:
    """`kiln convert`'s reader for every case; the command itself (`kiln.cli.main`, in this process: a
    spawned CLI costs seconds of imports) for the first one."""
    out, cases, markers, _ = family
    converted = [
        case for case in cases if case.startswith(("fsdp-sharded", "zero"))
    ]  # full/DDP: model.safetensors only
    for case in converted:
        ckpt = out / "convert_cases" / case / "checkpoint-2"
        with pytest.raises(CheckpointError) as err:
            convert_checkpoint(str(ckpt), str(out / "converted" / case))
        _refused(f"CheckpointError: {err.value}", markers[case]["convert"])
        assert not (out / "converted" / case / "model.safetensors").exists()
    ckpt = out / "convert_cases" / converted[0] / "checkpoint-2"
    capfd.readouterr()
    code = cli.main(["convert", str(ckpt), str(out / "converted_cli")])
    stderr = capfd.readouterr().err
    last = stderr.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in stderr and "Refusing to load" in last, stderr
    assert not os.path.exists(markers[converted[0]]["convert"])


@pytest.mark.distributed
def test_ddp_and_fsdp_planted_checkpoints_are_refused_on_resume(fsdp_family):
    _check_family(fsdp_family)


@pytest.mark.distributed
def test_fsdp_sharded_planted_checkpoints_are_refused_by_convert(fsdp_family, capfd):
    _check_convert(fsdp_family, capfd)


@pytest.mark.distributed
def test_deepspeed_planted_checkpoints_are_refused_on_resume(ds_family):
    out, cases, _, _ = ds_family
    assert {c.split("--")[0] for c in cases} == set(DS_FORMATS) and sum("optim_states" in c for c in cases) == 3
    _check_family(ds_family)


@pytest.mark.distributed
def test_deepspeed_planted_checkpoints_are_refused_by_convert(ds_family, capfd):
    _check_convert(ds_family, capfd)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state_0.pth", "loop_state_0.pt", "precision.pt"])
def test_single_process_planted_checkpoint_is_refused(tmp_path, name):
    out, cfg = str(tmp_path / "run"), {"max_steps": 2, "save_steps": 2}
    train(out, cfg)
    ckpt = tmp_path / "run" / "checkpoint-2"
    marker = str(tmp_path / "PWNED")
    plant(ckpt, name, marker)
    with pytest.raises(CheckpointError) as err:
        train(out, {**cfg, "max_steps": 3}, resume=str(ckpt))
    _refused(f"CheckpointError: {err.value}", marker)
    assert str(ckpt / name) in str(err.value)
