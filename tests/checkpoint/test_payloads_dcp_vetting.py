"""kiln.utils.safe_pickle on DCP folders written by plain torch (`dcp.save(no_dist=True)`), in this
process: what FSDP's sharded format and XLA FSDP's SPMD format (`xla_dcp/`, which torch_xla writes as
plain DCP) both read. A clean folder passes and consolidates; a `__reduce__` payload in the `.metadata`,
in a non-tensor entry or in a tensor entry is refused by `kiln convert`'s reader and by the XLA SPMD
loader (torch_xla stubbed: it is not installed here), and nothing from it runs."""

from __future__ import annotations

import io
import os
import pickle
import sys
import types

import pytest
import torch
from torch import nn

from kiln.strategies.xla.fsdp_checkpoint_io import SPMD_DIR, SPMDCheckpointIO, consolidate_spmd
from kiln.utils.errors import CheckpointError
from kiln.utils.safe_pickle import DCPMetadataUnpickler, UnsafePickle, load_dcp_metadata, vet_dcp_folder
from tests.checkpoint.planting import plant_dcp_entry, plant_dcp_metadata


def _dcp_checkpoint(directory) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A checkpoint folder holding `xla_dcp/` with a model and an Adam state, as SPMDCheckpointIO saves."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    dcp.save(
        {"model": model.state_dict(), "optim": opt.state_dict()},
        storage_writer=dcp.FileSystemWriter(os.path.join(directory, SPMD_DIR)),
        no_dist=True,
    )
    return model, opt


@pytest.fixture
def xla_stub(monkeypatch):
    """torch_xla's SPMD planners stood in by DCP's default ones; `prime_optimizer` does nothing."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    pkg, exp = types.ModuleType("torch_xla"), types.ModuleType("torch_xla.experimental")
    ckpt = types.ModuleType("torch_xla.experimental.distributed_checkpoint")
    ckpt.SPMDLoadPlanner, ckpt.prime_optimizer = DefaultLoadPlanner, lambda optimizer: None
    pkg.sync = lambda: None
    for name, module in (("torch_xla", pkg), ("torch_xla.experimental", exp), (ckpt.__name__, ckpt)):
        monkeypatch.setitem(sys.modules, name, module)


def test_a_clean_folder_passes_and_consolidates(tmp_path):
    model, _ = _dcp_checkpoint(tmp_path)
    meta = vet_dcp_folder(str(tmp_path / SPMD_DIR))
    assert "optim.param_groups.0.lr" in meta.state_dict_metadata
    weights = consolidate_spmd(str(tmp_path))
    assert set(weights) == {"weight", "bias"} and torch.equal(weights["weight"], model.weight.detach())


def test_a_clean_folder_loads_through_the_xla_spmd_loader(tmp_path, xla_stub):
    model, opt = _dcp_checkpoint(tmp_path)
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh(torch.randn(1, 3)).sum().backward()
    fresh_opt.step()  # state to load into (torch_xla's prime_optimizer does this on a TPU)
    SPMDCheckpointIO(None).load(str(tmp_path), model=fresh, module=fresh, optimizer=fresh_opt)
    assert torch.equal(fresh.weight, model.weight) and fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)


@pytest.mark.parametrize("target", ["metadata", "bytes", "tensor"])
def test_a_planted_payload_is_refused_by_convert_and_the_xla_loader(tmp_path, xla_stub, target):
    _dcp_checkpoint(tmp_path)
    folder, marker = tmp_path / SPMD_DIR, str(tmp_path / "PWNED")
    if target == "metadata":
        plant_dcp_metadata(folder, marker)
    else:
        plant_dcp_entry(folder, marker, target)
    with pytest.raises(CheckpointError, match="Refusing to load .*never executes code from a checkpoint") as err:
        consolidate_spmd(str(tmp_path))
    assert str(folder) in str(err.value) and "weights_only=False" not in str(err.value)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    with pytest.raises(CheckpointError, match="Refusing to load"):
        SPMDCheckpointIO(None).load(str(tmp_path), model=model, module=model, optimizer=opt)
    assert not os.path.exists(marker), "the planted payload ran"


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.metadata", "os.system"),  # a dotted walk out of an allowed module
        ("torch.distributed.checkpoint.metadata", "os"),
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("torch", "load"),
        ("torch.distributed.checkpoint.filesystem", "FileSystem"),
    ],
)
def test_the_metadata_unpickler_resolves_nothing_outside_the_allow_list(module, name):
    with pytest.raises(UnsafePickle):
        DCPMetadataUnpickler(io.BytesIO(f"c{module}\n{name}\n.".encode())).find_class(module, name)


def test_load_dcp_metadata_names_the_file_and_the_global(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(b"cposix\nsystem\n(S'touch " + str(tmp_path / "PWNED").encode() + b"'\ntR.")
    with pytest.raises(CheckpointError) as err:
        load_dcp_metadata(str(path))
    assert str(err.value).startswith(f"Refusing to load {path}: ") and "posix.system" in str(err.value)
    assert not (tmp_path / "PWNED").exists()
    path.write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match="is not distributed-checkpoint metadata"):
        load_dcp_metadata(str(path))
    path.write_bytes(pickle.dumps({"not": "metadata"})[:-3])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_dcp_metadata(str(path))
