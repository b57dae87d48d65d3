"""A sharded (DCP) checkpoint saved with two optimizer param groups resumes into two groups as it was
saved: same per-group settings, same Adam state. The loader counts the saved groups from the DCP
metadata (`optim.param_groups.<index>.<setting>`); a miscount sends a 2 -> 2 resume down the path for
the *other* layout (1 <-> 2 groups), which the cross-layout tests exercise but a same-layout resume
never would. DCP runs here without a process group (one process), on kiln's own save and load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.strategies.mesh.checkpoint_io import ShardedCheckpointIO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def _optimizer(model: nn.Sequential, groups: int, lr: float) -> torch.optim.AdamW:
    """HF's layout (decayed weights, then biases and norms) or kiln's one group, with distinct settings."""
    decay = [model[0].weight, model[2].weight]
    no_decay = [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    if groups == 1:
        return torch.optim.AdamW([{"params": decay + no_decay, "weight_decay": 0.0, "lr": lr}])
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1, "lr": lr}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]
    )


def _settings(optimizer: torch.optim.Optimizer) -> list[tuple[float, float, int]]:
    return [(g["lr"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups]


@pytest.mark.parametrize("groups", [2, 1])
def test_a_sharded_checkpoint_resumes_into_the_layout_it_was_saved_in(tmp_path, groups):
    model = _model()
    optimizer = _optimizer(model, groups, lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).square().sum().backward()
        optimizer.step()
    io = ShardedCheckpointIO()
    io.save(
        str(tmp_path),
        model=model,
        module=model,
        optimizer=optimizer,
        save_optimizer=True,
        safetensors=True,
        writer=True,
    )

    fresh = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    resumed = _optimizer(fresh, groups, lr=0.5)  # different settings: the saved ones must win
    io.load(str(tmp_path), model=fresh, module=fresh, optimizer=resumed)

    assert _settings(resumed) == _settings(optimizer)
    assert len(resumed.param_groups) == groups
    saved, got = optimizer.state_dict()["state"], resumed.state_dict()["state"]
    assert saved.keys() == got.keys() and len(saved) == 6
    for index in saved:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[index][key], saved[index][key], rtol=0, atol=0)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
