"""`memory_snapshot:` in a fake CUDA world (torch's allocator-history calls replaced by recorders, since
this machine has no GPU): recording starts and stops with training, snapshots land after the named steps
and at an out-of-memory error, whose note names the file and the largest allocation sites; on any other
device, and for step 0, the section is one sentence. A real fit on CPU refuses it before training."""

from __future__ import annotations

import pickle

import pytest
import torch
from omegaconf import OmegaConf

from kiln import Trainer
from kiln.config import load_config
from kiln.engine.callbacks.memory_snapshot import MemorySnapshot, largest_sites, memory_snapshot_callback
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.utils.errors import ConfigError
from tests.helpers import TinyRegressor, base_config, regression_data


def block(size: int, filename: str, line: int, state: str = "active_allocated") -> dict:
    return {
        "size": size,
        "state": state,
        "frames": [{"filename": "alloc.cpp", "line": 1}, {"filename": filename, "line": line}],
    }


SNAPSHOT = {
    "segments": [
        {
            "blocks": [
                block(3 << 20, "model.py", 10),
                block(1 << 20, "model.py", 10),
                block(5 << 20, "loss.py", 7),
                block(9 << 20, "old.py", 1, state="inactive"),
            ]
        }
    ]
}


@pytest.fixture
def fake_cuda(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: SNAPSHOT)
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", lambda fn: calls.append(("observer", fn)), raising=False
    )
    return calls


def config(tmp_path, **section):  # type: ignore[no-untyped-def]
    return load_config(OmegaConf.create(base_config(tmp_path, memory_snapshot=section)))


def events(callback, steps):  # type: ignore[no-untyped-def]
    cfg, state, control = None, TrainerState(), TrainerControl()
    callback.on_train_begin(cfg, state, control)
    for step in range(1, steps + 1):
        state.global_step = step
        callback.on_step_end(cfg, state, control)
    callback.on_train_end(cfg, state, control)


def test_snapshots_follow_the_named_steps_and_recording_brackets_training(tmp_path, fake_cuda):
    callback = memory_snapshot_callback(config(tmp_path, steps=[3, 1], max_entries=50), 1, "cuda")
    assert isinstance(callback, MemorySnapshot)
    events(callback, steps=4)
    folder = tmp_path / "out" / "memory_snapshots" / "rank1"
    assert sorted(p.name for p in folder.iterdir()) == ["step1.pickle", "step3.pickle"]
    assert pickle.loads((folder / "step3.pickle").read_bytes()) == SNAPSHOT
    assert fake_cuda == [("record", (), {"max_entries": 50}), ("record", (), {"enabled": None})]  # no observer


def test_an_out_of_memory_dumps_a_snapshot_and_names_it_with_the_largest_sites(tmp_path, fake_cuda):
    callback = memory_snapshot_callback(config(tmp_path, on_oom=True, output_dir=str(tmp_path / "mem")), 0, "cuda")
    events(callback, steps=1)
    [(kind, observer)] = [c for c in fake_cuda if c[0] == "observer"]
    assert callback.oom_note() is None  # nothing ran out yet
    observer(0, 1 << 30, 0, 0)
    path = tmp_path / "mem" / "rank0" / "oom.pickle"
    assert pickle.loads(path.read_bytes()) == SNAPSHOT
    note = callback.oom_note()
    assert str(path) in note and "loss.py:7 (5.0 MiB); model.py:10 (4.0 MiB)" in note and "old.py" not in note


def test_largest_sites_charge_blocks_to_their_innermost_python_frame():
    assert largest_sites(SNAPSHOT, top=1) == [("loss.py:7", 5 << 20)]
    assert largest_sites({"segments": [{"blocks": [{"size": 8, "state": "active_allocated", "frames": []}]}]}) == [
        ("<no Python frame>", 8)
    ]


def test_off_by_default_and_one_sentence_for_other_devices_and_step_zero(tmp_path):
    assert memory_snapshot_callback(config(tmp_path), 0, "cpu") is None
    with pytest.raises(ConfigError, match="trains on cpu; remove the memory_snapshot section or train on a GPU"):
        memory_snapshot_callback(config(tmp_path, on_oom=True), 0, "cpu")
    with pytest.raises(ConfigError, match="memory_snapshot.steps holds 0"):
        memory_snapshot_callback(config(tmp_path, steps=[0, 2]), 0, "cuda")


def test_a_cpu_fit_refuses_the_section_before_training(tmp_path):
    cfg = load_config(OmegaConf.create(base_config(tmp_path, memory_snapshot={"steps": [1]}, train={"max_steps": 2})))
    model = TinyRegressor()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match="memory_snapshot"):
        Trainer(model, cfg, train_dataset=regression_data(8)).fit()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_note_goes_on_an_out_of_memory_error_only(tmp_path, fake_cuda):
    callback = memory_snapshot_callback(config(tmp_path, on_oom=True), 0, "cuda")
    events(callback, steps=1)
    other = RuntimeError("shapes do not match")
    callback.on_exception(None, TrainerState(), TrainerControl(), exception=other)
    oom = torch.OutOfMemoryError("CUDA out of memory")
    callback.on_exception(None, TrainerState(), TrainerControl(), exception=oom)
    assert not hasattr(oom, "__notes__")  # nothing ran out in the allocator yet: no snapshot to name
    [(kind, observer)] = [c for c in fake_cuda if c[0] == "observer"]
    observer(0, 1 << 30, 0, 0)
    callback.on_exception(None, TrainerState(), TrainerControl(), exception=oom)
    callback.on_exception(None, TrainerState(), TrainerControl(), exception=other)
    assert oom.__notes__ == [callback.oom_note()] and not hasattr(other, "__notes__")
