"""Checkpoint formats as a registry: `kiln convert` looks the COMPLETE marker's format up in
kiln.strategies.checkpoint_io.FORMATS and imports only that format's module; an unknown format is one
sentence listing the known ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.engine.checkpoint.convert import convert_checkpoint
from kiln.engine.checkpoint.files import _fsync_tree
from kiln.engine.checkpoint.integrity import ALGORITHM, VERSION
from kiln.strategies.checkpoint_io import FORMATS
from kiln.strategies.model_weights import save_weights
from kiln.utils.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(folder: Path, fmt: str) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True)
    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    save_weights(weights, str(folder))
    _mark(folder, fmt)
    return weights


def _mark(folder: Path, fmt: str) -> None:
    """A COMPLETE marker as kiln writes it: the files it lists, their sizes and digests."""
    files, digests = _fsync_tree(str(folder))
    (folder / "COMPLETE").write_text(
        json.dumps({"format": fmt, "step": 1, "version": VERSION, "files": files, ALGORITHM: digests})
    )


def test_convert_imports_only_the_module_of_the_format_it_reads(tmp_path):
    _checkpoint(tmp_path / "ckpt", "fsdp-full")
    code = (
        "import sys; from kiln.engine.checkpoint.convert import convert_checkpoint; "
        f"convert_checkpoint({str(tmp_path / 'ckpt')!r}, {str(tmp_path / 'out')!r}); "
        "print(sorted(m for m in sys.modules if m.startswith('kiln.strategies.') and 'checkpoint_io' in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    # the full-state IO comes with the mesh's: fsdp-full holds the same files, read by the same code
    assert out.strip() == (
        "['kiln.strategies.checkpoint_io', 'kiln.strategies.full_checkpoint_io', 'kiln.strategies.mesh.checkpoint_io']"
    )


def test_convert_writes_the_full_weights_and_refuses_an_unknown_format(tmp_path):
    weights = _checkpoint(tmp_path / "ckpt", "xla-full")
    from safetensors.torch import load_file

    converted = load_file(convert_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out")))
    assert converted.keys() == weights.keys() and all(torch.equal(converted[k], weights[k]) for k in weights)
    (tmp_path / "ckpt" / "COMPLETE").unlink()
    _mark(tmp_path / "ckpt", "martian")
    with pytest.raises(
        CheckpointError,
        match=r"^kiln convert cannot read checkpoints of format 'martian'; it reads "
        r"deepspeed, (.*, )?fsdp-full, fsdp-sharded, full, .*xla-spmd-sharded\.$",
    ):
        convert_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out2"))


def test_a_format_registered_by_a_plug_in_is_converted(tmp_path):
    from kiln.strategies.checkpoint_io import CheckpointIO, register_format

    @register_format
    class Doubled(CheckpointIO):
        format = "test-doubled"

        @classmethod
        def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
            return {k: v * 2 for k, v in FORMATS.get("full").consolidate(directory).items()}

    weights = _checkpoint(tmp_path / "ckpt", "test-doubled")
    from safetensors.torch import load_file

    converted = load_file(convert_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out")))
    assert torch.equal(converted["w"], weights["w"] * 2)


@pytest.mark.parametrize(
    "module, name",
    [
        ("kiln.strategies.mesh.checkpoint_io", "DCP_DIR"),  # fsdp and model_parallel write it today
        (
            "kiln.strategies.mesh.checkpoint_io",
            "LEGACY_MODEL_PARALLEL_DIR",
        ),  # model_parallel's, before the mesh strategy
        ("kiln.strategies.xla.fsdp_checkpoint_io", "SPMD_DIR"),
        ("kiln.strategies.xla.fsdp_checkpoint_io", "CLASSIC_DIR"),
        ("kiln.strategies.deepspeed.checkpoint_io", "TAG"),
    ],
)
def test_a_sharded_checkpoint_without_its_marker_is_never_taken_for_one_hf_wrote(tmp_path, module, name):
    """hf_folder names the strategies' folders rather than importing them: each folder a sharded
    strategy writes (or wrote) must keep such a folder from passing for an HF checkpoint."""
    import importlib

    from kiln.engine.checkpoint.hf_folder import is_hf_checkpoint, kiln_files

    folder = getattr(importlib.import_module(module), name)
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / folder).mkdir()
    assert kiln_files(str(tmp_path)) == [folder] and not is_hf_checkpoint(str(tmp_path))
