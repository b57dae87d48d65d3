"""`train.torch_compile*` and `torch_compile.regions` read in one place (kiln/config/compile.py): a backend or a mode alone implies
compiling, as in HF's TrainingArguments; nothing set compiles nothing."""

from __future__ import annotations

import pytest

from kiln.config import load_config
from kiln.config.compile import compiles_model, model_compile_kwargs


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], None),
        (["torch_compile=true"], {"backend": "inductor", "mode": None}),
        (["torch_compile_backend=eager"], {"backend": "eager", "mode": None}),
        (["torch_compile_mode=reduce-overhead"], {"backend": "inductor", "mode": "reduce-overhead"}),
        (["torch_compile.regions=blocks", "torch_compile_backend=eager"], {"backend": "eager", "mode": None}),
        (["torch_compile.regions=blocks"], {"backend": "inductor", "mode": None}),
    ],
)
def test_a_backend_or_a_mode_implies_compiling(tmp_path, overrides, expected):
    config = load_config({"output_dir": str(tmp_path)}, overrides)
    assert compiles_model(config) is (expected is not None)
    assert model_compile_kwargs(config) == expected


def test_no_config_compiles_nothing():
    assert compiles_model(None) is False
