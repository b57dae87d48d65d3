"""XLA checkpoints and exports keep a weight tie as one tensor. Copying an XLA tensor to the host
makes new storage per tensor object, so the tie survives only if both names reach the copy as the
SAME object: `state_dict(keep_vars=True)` hands back the Parameter itself under each name, while the
default hands back a fresh `detach()` per name. On CPU tensors the two still share storage, so the
saved file looks right either way; the identity of the copied tensors is what is asserted here
(tests/xla/test_xla_tied_export.py checks the file on a real XLA device). No torch_xla is needed:
this code path only calls `.to("cpu")`."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from torch import nn

from kiln.strategies.xla.checkpoint_io import XLACheckpointIO, module_state_cpu, to_cpu


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


def test_module_state_hands_the_tie_to_the_copy_as_one_object():
    state = module_state_cpu(Tied())
    assert state["emb.weight"] is state["head.weight"]
    assert not state["emb.weight"].requires_grad  # a detached copy, not the live Parameter


def test_to_cpu_copies_one_object_reached_twice_once():
    t = torch.ones(3)
    tree = {"a": t, "b": [t, {"c": t}], "d": torch.ones(3)}
    out = to_cpu(tree)
    assert out["a"] is out["b"][0] is out["b"][1]["c"]
    assert out["d"] is not out["a"]


def test_the_checkpoint_stores_the_tie_once(tmp_path):
    model = Tied()
    XLACheckpointIO().save(
        str(tmp_path), model=model, module=model, optimizer=None, save_optimizer=False, safetensors=True, writer=True
    )
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        keys, meta = list(fh.keys()), fh.metadata()
    assert keys == ["emb.weight"] and json.loads(meta["kiln_aliases"]) == {"head.weight": "emb.weight"}
