"""kiln/launch/environment/variables.py: the environment kiln reads or sets outside a launcher's topology, so that
the rest of kiln never touches it (tests/test_layering.py holds that rule)."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.launch.environment.variables import export_default, python_path


def test_a_librarys_default_never_overrides_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_TEST_DEFAULT", raising=False)
    export_default("KILN_TEST_DEFAULT", "kiln's")
    assert os.environ["KILN_TEST_DEFAULT"] == "kiln's"
    monkeypatch.setenv("KILN_TEST_DEFAULT", "user's")
    export_default("KILN_TEST_DEFAULT", "kiln's")
    assert os.environ["KILN_TEST_DEFAULT"] == "user's"


def test_full_determinism_gives_cublas_its_workspace_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.engine.seed import enable_full_determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    deterministic = torch.are_deterministic_algorithms_enabled()
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:
        enable_full_determinism()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        enable_full_determinism()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def test_the_import_path_is_none_when_unset_or_empty() -> None:
    assert python_path({"PYTHONPATH": "/a:/b"}) == "/a:/b"
    assert python_path({"PYTHONPATH": ""}) is None and python_path({}) is None
