"""The rest of XLACheckpointIO's save that runs without torch_xla (CPU tensors): the optimizer state is
written (host copies) exactly when asked for, mapping types survive the host copy, and the format is
declared reshardable (a full checkpoint resumes on any number of processes)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from kiln.strategies.xla.checkpoint_io import XLACheckpointIO, to_cpu


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(directory, model, optimizer, save_optimizer: bool, writer: bool = True) -> None:
    XLACheckpointIO().save(
        str(directory),
        model=model,
        module=model,
        optimizer=optimizer,
        save_optimizer=save_optimizer,
        safetensors=True,
        writer=writer,
    )


def test_the_optimizer_state_is_saved_when_asked_for(tmp_path):
    model, optimizer = _stepped()
    _save(tmp_path, model, optimizer, save_optimizer=True)
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    want = optimizer.state_dict()
    assert saved["param_groups"] == want["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][index][key], value, rtol=0, atol=0)


def test_no_optimizer_file_without_save_optimizer_or_on_a_non_writer(tmp_path):
    model, optimizer = _stepped()
    for name in ("only_model", "other_rank"):
        (tmp_path / name).mkdir()  # the checkpoint manager makes the folder
    _save(tmp_path / "only_model", model, optimizer, save_optimizer=False)
    assert sorted(p.name for p in (tmp_path / "only_model").iterdir()) == ["model.safetensors"]
    _save(tmp_path / "other_rank", model, optimizer, save_optimizer=True, writer=False)
    assert not list((tmp_path / "other_rank").iterdir())


def test_mapping_types_survive_the_host_copy():
    t = torch.ones(2)
    copied = to_cpu(OrderedDict(a=t, b={"c": t}))
    assert type(copied) is OrderedDict and type(copied["b"]) is dict
    assert copied["a"] is copied["b"]["c"]


def test_the_format_is_a_reshardable_full_checkpoint():
    assert XLACheckpointIO.format == "xla-full" and XLACheckpointIO.reshardable is True
