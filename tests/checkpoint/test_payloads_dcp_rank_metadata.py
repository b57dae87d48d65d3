"""The per-rank `__<rank>.metadata` files torch's distributed checkpoint can write beside `.metadata`
are pickles too; kiln's vetting reads each with its restricted unpickler before any DCP reader sees the
folder (issue 58). A payload planted in one (it would create a marker file when unpickled) is refused
by the vetting, by `kiln convert`'s FSDP and XLA readers, and never runs."""

from __future__ import annotations

import os
import pickle

import pytest

from kiln.strategies.checkpoint_io import FORMATS
from kiln.strategies.xla.fsdp_checkpoint_io import SPMD_DIR, consolidate_spmd
from kiln.utils.errors import CheckpointError
from kiln.utils.safe_pickle import vet_dcp_folder
from tests.checkpoint.planting import Payload
from tests.checkpoint.test_payloads_dcp_vetting import _dcp_checkpoint


@pytest.mark.parametrize("name", ["__0.metadata", "__1.metadata"])
def test_a_payload_in_a_per_rank_metadata_file_is_refused_and_never_runs(tmp_path, name):
    _dcp_checkpoint(tmp_path)
    folder, marker = tmp_path / SPMD_DIR, tmp_path / "PWNED"
    vet_dcp_folder(str(folder))  # clean: passes
    (folder / name).write_bytes(pickle.dumps(Payload(str(marker))))
    for read in (lambda: vet_dcp_folder(str(folder)), lambda: consolidate_spmd(str(tmp_path))):
        with pytest.raises(
            CheckpointError,
            match=rf"^Refusing to load {folder / name}: .*global _?io\.open is not allowed.*"
            "never executes code from a checkpoint",
        ):
            read()  # `open` pickles as io.open on Python 3.11, _io.open on 3.12
    assert not marker.exists(), "the planted payload ran"


def test_the_fsdp_reader_vets_per_rank_metadata_too(tmp_path):
    """The FSDP sharded format's `kiln convert` reader, on the same DCP layout under its folder name."""
    _dcp_checkpoint(tmp_path)
    fsdp = tmp_path / "fsdp_dcp"
    os.rename(tmp_path / SPMD_DIR, fsdp)
    marker = tmp_path / "PWNED"
    (fsdp / "__0.metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(CheckpointError, match=rf"^Refusing to load {fsdp / '__0.metadata'}: "):
        FORMATS.get("fsdp-sharded").consolidate(str(tmp_path))
    assert not marker.exists(), "the planted payload ran"
