"""Issue 34: loading a checkpoint never runs code from it, in any format kiln writes.

A `__reduce__` payload (it would create a marker file: a stand-in for any code) is planted in every
pickle-bearing file of a real checkpoint of each format: single (optimizer, scheduler, RNG, loop and
precision state), DDP, FSDP full and sharded (the DCP `.metadata`, a non-tensor entry and a tensor entry
of a `.distcp` file), DeepSpeed ZeRO 0-3 (every `.pt` under `ds/`). The planted files are otherwise
intact and the COMPLETE marker is rewritten to match, as an attacker controlling the folder would. Resuming
and `kiln convert` must both raise CheckpointError with one clear sentence, and the marker never appears.
FSDP and DDP run on 2 processes, DeepSpeed on 1 (gloo on CPU); each family is one save and one resume
launch, whatever the number of cases."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kiln.engine.checkpoint.convert import convert_checkpoint
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import train
from tests.distributed.conftest import run

HERE = Path(__file__).resolve().parent
WORKER = HERE / "payload_worker.py"
DS = "ds"


class Payload:
    """Unpickling this creates `marker` (the file stands in for any code an attacker would run)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# -- planting -------------------------------------------------------------------------------------
def plant_torch_file(path: Path, marker: str) -> None:
    """Add the payload to a torch-format file (kiln's own state files, DeepSpeed's shards), which
    otherwise stays exactly what was saved: loaded unguarded, it would work and run the payload."""
    state = torch.load(path, map_location="cpu", weights_only=False)  # the test's own fresh file
    if not isinstance(state, dict):
        state = {"state": state}
    state["kiln_test_payload"] = Payload(marker)
    torch.save(state, path)


def _read_metadata(folder: Path):
    with open(folder / ".metadata", "rb") as fh:
        return pickle.load(fh)  # the test's own fresh file


def _write_metadata(folder: Path, meta) -> None:
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)


def plant_dcp_metadata(folder: Path, marker: str) -> None:
    meta = _read_metadata(folder)
    meta.__dict__["kiln_test_payload"] = Payload(marker)  # an extra attribute: DCP would ignore it after unpickling
    _write_metadata(folder, meta)


def plant_dcp_entry(folder: Path, marker: str, kind: str) -> None:
    """Point one entry of the `.metadata` (a non-tensor "bytes" entry such as an optimizer's lr, or a
    tensor) at a pickle holding the payload, appended to the `.distcp` file that held the entry."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    meta = _read_metadata(folder)
    wanted = BytesStorageMetadata if kind == "bytes" else TensorStorageMetadata
    index = next(
        i
        for i in meta.storage_data
        if isinstance(meta.state_dict_metadata[i.fqn], wanted)
        and i.fqn.startswith("optim." if kind == "bytes" else "model.")
    )
    info = meta.storage_data[index]
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as fh:
        fh.write(buf.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    _write_metadata(folder, meta)


def remark(ckpt: Path) -> None:
    """Rewrite COMPLETE so its sizes and checksums match the planted files: an attacker controls the
    whole folder, so it looks complete and intact."""
    from kiln.engine.checkpoint.integrity import ALGORITHM, file_digest

    meta = json.loads((ckpt / "COMPLETE").read_text())
    meta["files"] = {f: (ckpt / f).stat().st_size for f in meta["files"]}
    if isinstance(meta.get(ALGORITHM), dict):
        meta[ALGORITHM] = {f: file_digest(str(ckpt / f)) for f in meta[ALGORITHM]}
    (ckpt / "COMPLETE").write_text(json.dumps(meta))


def plant(ckpt: Path, target: str, marker: str) -> None:
    if target == "dcp-metadata":
        plant_dcp_metadata(ckpt / "fsdp_dcp", marker)
    elif target in ("dcp-bytes", "dcp-tensor"):
        plant_dcp_entry(ckpt / "fsdp_dcp", marker, target.split("-")[1])
    else:
        plant_torch_file(ckpt / target, marker)
    remark(ckpt)


#: case "<format>--<target>" for the worker formats; DeepSpeed targets are every .pt file under ds/
FSDP_CASES = [
    "fsdp-sharded--dcp-metadata",
    "fsdp-sharded--dcp-bytes",
    "fsdp-sharded--dcp-tensor",
    "fsdp-full--optimizer.pt",
    "ddp--optimizer.pt",
    "ddp--scheduler.pt",
]
DS_FORMATS = ["zero0", "zero1", "zero2", "zero3"]


def _launch(nproc: int, out: Path, *args: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        str(out),
        *args,
    ]
    run(cmd, timeout=900, env={"DS_ACCELERATOR": "cpu"})


def _prepare(out: Path, cases: list[str]) -> dict[str, dict[str, str]]:
    """Plant every case twice (one copy to resume, one to convert); returns case -> action -> marker."""
    markers: dict[str, dict[str, str]] = {}
    (out / "markers").mkdir()
    for case in cases:
        fmt, target = case.split("--")
        markers[case] = {}
        for action in ("resume", "convert"):
            ckpt = out / ("cases" if action == "resume" else "convert_cases") / case / "checkpoint-2"
            shutil.copytree(out / fmt / "checkpoint-2", ckpt)
            markers[case][action] = str(out / "markers" / f"{case}.{action}")
            plant(ckpt, target.replace("__", "/"), markers[case][action])
    return markers


def _family(
    tmp_path_factory, name: str, nproc: int, formats: list[str], cases_of
) -> tuple[Path, list[str], dict, list[dict]]:
    out = tmp_path_factory.mktemp(name)
    _launch(nproc, out, "save", *formats)
    cases = cases_of(out)
    markers = _prepare(out, cases)
    _launch(nproc, out, "resume", *cases)
    results = [json.loads((out / f"resumed_{r}.json").read_text()) for r in range(nproc)]
    return out, cases, markers, results


def _ds_cases(out: Path) -> list[str]:
    """Every .pt DeepSpeed wrote, per ZeRO stage ("__" stands for "/")."""
    return [
        f"{fmt}--{DS}__{f.name}" for fmt in DS_FORMATS for f in sorted((out / fmt / "checkpoint-2" / DS).glob("*.pt"))
    ]


@pytest.fixture(scope="module")
def fsdp_family(tmp_path_factory):
    return _family(tmp_path_factory, "payload_fsdp", 2, ["ddp", "fsdp-sharded", "fsdp-full"], lambda out: FSDP_CASES)


@pytest.fixture(scope="module")
def ds_family(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _family(tmp_path_factory, "payload_ds", 1, DS_FORMATS, _ds_cases)


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


def _check_convert(family) -> None:
    """`kiln convert`'s reader in this process for every case; the CLI itself for the first one."""
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
    proc = run(
        [sys.executable, "-m", "kiln.cli", "convert", str(ckpt), str(out / "converted_cli")],
        timeout=300,
        check=False,
        env={"DS_ACCELERATOR": "cpu"},
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "Refusing to load" in last, proc.stderr
    assert not os.path.exists(markers[converted[0]]["convert"])


@pytest.mark.distributed
def test_ddp_and_fsdp_planted_checkpoints_are_refused_on_resume(fsdp_family):
    _check_family(fsdp_family)


@pytest.mark.distributed
def test_fsdp_sharded_planted_checkpoints_are_refused_by_convert(fsdp_family):
    _check_convert(fsdp_family)


@pytest.mark.distributed
def test_deepspeed_planted_checkpoints_are_refused_on_resume(ds_family):
    out, cases, _, _ = ds_family
    assert {c.split("--")[0] for c in cases} == set(DS_FORMATS) and sum("optim_states" in c for c in cases) == 3
    _check_family(ds_family)


@pytest.mark.distributed
def test_deepspeed_planted_checkpoints_are_refused_by_convert(ds_family):
    _check_convert(ds_family)


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
