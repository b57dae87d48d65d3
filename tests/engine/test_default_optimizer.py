"""The default optimizer is HF's: `adamw_torch_fused` on torch >= 2.8 (transformers 5's
`TrainingArguments.optim`), stepping with `adamw_torch`'s kernels on a device torch has no fused kernel
for; a checkpoint resumes with this run's kernel, whichever kernel saved it."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.config.schema.optim import OptimConfig, hf_default_optimizer
from kiln.optim.optimizers import build_optimizer
from tests.checkpoint.checkpoint_helpers import Crash, train, weights

CFG = {"max_steps": 10, "save_steps": 5, "lr_scheduler_type": "linear", "warmup_steps": 2, "weight_decay": 0.01}


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls of torch's fused AdamW kernel (one per param group and step)."""
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def test_the_default_is_the_one_of_the_installed_transformers():
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir="unused", report_to=[])
    assert OptimConfig().name == str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused"


@pytest.mark.parametrize(
    "installed,name",
    [
        ("2.7.1", "adamw_torch"),
        ("2.8.0", "adamw_torch_fused"),
        ("2.13.0+cpu", "adamw_torch_fused"),
        ("3.0.0a0+git12ab", "adamw_torch_fused"),
        ("1.13.1", "adamw_torch"),
        ("unknown", "adamw_torch"),
    ],
)
@pytest.mark.parametrize("source", ["imported torch", "installed metadata"])
def test_hfs_rule_by_torch_version(monkeypatch, installed, name, source):
    import importlib.metadata
    import sys
    import types

    # torch is out of sys.modules only for the call: anything that imports torch before the test's
    # fixtures are undone (a plugin's teardown hook) would run torch/__init__.py a second time, which
    # fails, and fails every later test of the process with it
    with monkeypatch.context() as patched:
        if source == "imported torch":
            patched.setitem(sys.modules, "torch", types.SimpleNamespace(__version__=installed))
        else:
            patched.delitem(sys.modules, "torch")
            patched.setattr(importlib.metadata, "version", lambda package: installed)
        chosen = hf_default_optimizer()
    assert chosen == name


def test_without_torch_installed_the_default_is_adamw_torch(monkeypatch):
    import importlib.metadata
    import sys

    def version(package):
        raise importlib.metadata.PackageNotFoundError(package)

    with monkeypatch.context() as patched:  # only for the call (see test_hfs_rule_by_torch_version)
        patched.delitem(sys.modules, "torch")
        patched.setattr(importlib.metadata, "version", version)
        chosen = hf_default_optimizer()
    assert chosen == "adamw_torch"


def test_a_default_run_steps_with_the_fused_kernel(tmp_path, fused_calls):
    trainer = train(str(tmp_path / "run"), {**CFG, "save_steps": 100})
    assert all(group["fused"] is True for group in trainer.optimizer.param_groups)
    assert len(fused_calls) == 2 * 10  # HF's two param groups, 10 steps


def test_without_a_fused_kernel_for_the_device_it_steps_as_adamw_torch(tmp_path, monkeypatch, caplog, fused_calls):
    import torch.utils._foreach_utils as foreach_utils

    plain = train(str(tmp_path / "plain"), {**CFG, "save_steps": 100, "optim": "adamw_torch"})
    device = next(plain.model.parameters()).device.type  # cpu, or cuda where a GPU is
    supported = [d for d in foreach_utils._get_fused_kernels_supported_devices() if d != device]
    monkeypatch.setattr(foreach_utils, "_get_fused_kernels_supported_devices", lambda: supported)  # as for XLA
    with caplog.at_level(logging.INFO, logger="kiln.optim.optimizers"):
        fallback = train(str(tmp_path / "fallback"), {**CFG, "save_steps": 100})
    assert not fused_calls
    assert all(not group["fused"] for group in fallback.optimizer.param_groups)
    assert f"no fused kernel for {device} parameters" in caplog.text
    a, b = weights(plain), weights(fallback)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the very same kernels as adamw_torch


def test_parameters_on_a_device_without_fused_kernels_build_without_fused():
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, OptimConfig(name="adamw_torch_fused"))
    assert not any(group["fused"] for group in optimizer.param_groups)
    assert build_optimizer(torch.nn.Linear(3, 2), OptimConfig(name="adamw_torch_fused")).param_groups[0]["fused"]


@pytest.mark.parametrize("saved,resumed", [("adamw_torch", "adamw_torch_fused"), ("adamw_torch_fused", "adamw_torch")])
def test_a_checkpoint_resumes_with_this_runs_kernel(tmp_path, fused_calls, saved, resumed):
    straight = train(str(tmp_path / "straight"), {**CFG, "optim": saved})
    out = str(tmp_path / "crashed")
    with pytest.raises(Crash):
        train(out, {**CFG, "optim": saved}, crash_at=5)
    fused_calls.clear()
    done = train(out, {**CFG, "optim": resumed}, model_seed=1234, resume=True)
    fused = resumed == "adamw_torch_fused"
    assert [bool(g["fused"]) for g in done.optimizer.param_groups] == [fused, fused]
    assert len(fused_calls) == (2 * 5 if fused else 0)  # steps 6-10, two groups
    assert [g["weight_decay"] for g in done.optimizer.param_groups] == [0.01, 0.0]  # the saved settings stay
    a, b = weights(straight), weights(done)
    for k in a:  # the two kernels differ in roundoff only
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


class _Split(torch.nn.Module):
    """Two linear layers whose weights stand in for DTensors (their `device_mesh`), as model_parallel's tp
    plan leaves the unplanned parameters plain."""

    def __init__(self, meshes):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
        for layer, mesh in zip((self.a, self.b), meshes):
            if mesh is not None:
                layer.weight.device_mesh = mesh


@pytest.mark.parametrize("name", ["adamw_torch_fused", "adamw_torch_foreach", "adamw_torch"])
@pytest.mark.parametrize("meshes", [("mesh", None), ("mesh", "other mesh")], ids=["dtensor+plain", "two meshes"])
def test_a_group_no_multi_tensor_kernel_spans_steps_per_parameter(caplog, name, meshes):
    with caplog.at_level(logging.INFO, logger="kiln.optim.optimizers"):
        optimizer = build_optimizer(_Split(meshes), OptimConfig(name=name))
    assert all(group["foreach"] is False and not group["fused"] for group in optimizer.param_groups)
    assert "mixes DTensors with plain tensors" in caplog.text


def test_one_mesh_keeps_the_named_kernel():
    assert build_optimizer(_Split(("mesh", "mesh")), OptimConfig(name="adamw_torch_fused")).param_groups[0]["fused"]
    assert build_optimizer(_Split((None, None)), OptimConfig(name="adamw_torch_foreach")).param_groups[0]["foreach"]


def test_an_adamw_torch_checkpoint_resumes_under_fp16_with_the_fused_default(tmp_path, monkeypatch, fused_calls):
    """GradScaler hands a fused optimizer its found_inf at each step: had the checkpoint's `fused: None` been
    restored, torch's per-parameter kernel would get it and assert at the first resumed step."""
    monkeypatch.setattr("kiln.accelerators.cpu.cpu_supports_fp16", lambda: True)  # fp16 rules pass on this CPU
    cfg = {**CFG, "precision": "fp16"}
    out = str(tmp_path / "crashed")
    with pytest.raises(Crash):
        train(out, {**cfg, "optim": "adamw_torch"}, crash_at=5)
    fused_calls.clear()
    done = train(out, cfg, model_seed=1234, resume=True)
    assert done.state.global_step == 10 and len(fused_calls) == 2 * 5
