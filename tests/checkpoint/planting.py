"""Planting a code-running pickle payload in a real checkpoint, as an attacker controlling the folder
would (test_planted_payloads.py); used by the test and, in one launch with the save and the resume, by
payload_worker.py on rank 0."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import torch

DS = "ds"
#: case "<format>--<target>" for the FSDP/DDP family; DeepSpeed targets are every .pt file under ds/
FSDP_CASES = [
    "fsdp-sharded--dcp-metadata",
    "fsdp-sharded--dcp-bytes",
    "fsdp-sharded--dcp-tensor",
    "fsdp-full--optimizer.pt",
    "ddp--optimizer.pt",
    "ddp--scheduler.pt",
]
DS_FORMATS = ["zero0", "zero1", "zero2", "zero3"]


class Payload:
    """Unpickling this creates `marker` (the file stands in for any code an attacker would run)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


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


def ds_cases(out: Path) -> list[str]:
    """Every .pt DeepSpeed wrote, per ZeRO stage ("__" stands for "/")."""
    return [
        f"{fmt}--{DS}__{f.name}" for fmt in DS_FORMATS for f in sorted((out / fmt / "checkpoint-2" / DS).glob("*.pt"))
    ]


#: family -> (formats saved, its cases once saved)
FAMILIES = {"fsdp": (["ddp", "fsdp-sharded", "fsdp-full"], lambda out: FSDP_CASES), "ds": (DS_FORMATS, ds_cases)}


def prepare(out: Path, family: str) -> dict[str, dict[str, str]]:
    """Plant every case of `family` twice, from OUT/<format>/checkpoint-2 (one copy to resume under
    OUT/cases, one to convert under OUT/convert_cases); returns case -> action -> marker."""
    markers: dict[str, dict[str, str]] = {}
    (out / "markers").mkdir()
    for case in FAMILIES[family][1](out):
        fmt, target = case.split("--")
        markers[case] = {}
        for action in ("resume", "convert"):
            ckpt = out / ("cases" if action == "resume" else "convert_cases") / case / "checkpoint-2"
            shutil.copytree(out / fmt / "checkpoint-2", ckpt)
            markers[case][action] = str(out / "markers" / f"{case}.{action}")
            plant(ckpt, target.replace("__", "/"), markers[case][action])
    return markers
