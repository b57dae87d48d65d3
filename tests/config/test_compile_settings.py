"""`train.torch_compile*` read in one place (kiln/config/compile.py): a backend or a mode alone implies
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
    ],
)
def test_a_backend_or_a_mode_implies_compiling(tmp_path, overrides, expected):
    train = load_config({"output_dir": str(tmp_path)}, overrides).train
    assert compiles_model(train) is (expected is not None)
    assert model_compile_kwargs(train) == expected


def test_no_train_section_compiles_nothing():
    assert compiles_model(None) is False
