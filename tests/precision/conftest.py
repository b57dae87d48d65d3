"""Shared fixtures for the precision plugin tests: a config factory, and a guard that no test leaks
process-wide numeric state (TF32 flags, the default dtype) into the next one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from kiln.config.schema import TrainingConfig
from kiln.precision.tf32_flags import tf32_state


def precision_config(**precision: Any) -> DictConfig:
    """The full config tree with `precision.<key>` overridden (no validation: these are unit tests)."""
    cfg = OmegaConf.structured(TrainingConfig)
    for key, value in precision.items():
        cfg.precision[key] = value
    return cfg


@pytest.fixture
def make_config() -> Callable[..., DictConfig]:
    return precision_config


@pytest.fixture
def fp16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this CPU has oneDNN fp16 kernels, so the fp16 rules let fp16 run here (autocast fp16
    and GradScaler('cpu') work without them, only more slowly)."""
    monkeypatch.setattr("kiln.accelerators.cpu.cpu_supports_fp16", lambda: True)


@pytest.fixture
def no_fp16_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without oneDNN fp16 kernels (this machine's kind), with the once-per-process slow-fp16
    warning not yet given."""
    monkeypatch.setattr("kiln.accelerators.cpu.cpu_supports_fp16", lambda: False)
    monkeypatch.setattr("kiln.precision.base._SLOW_FP16_WARNED", [False])


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds contention (10x slower on a busy
    2-core machine) and changes no result that a test compares."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_leaked_numeric_state():
    flags, dtype = tf32_state(), torch.get_default_dtype()
    yield
    assert tf32_state() == flags, "a test left TF32 flags changed"
    assert torch.get_default_dtype() == dtype, "a test left the default dtype changed"
