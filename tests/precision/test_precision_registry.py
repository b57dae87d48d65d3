"""Names -> plugin classes, unknown names, apex routing of HF's half_precision_backend, laziness."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from kiln.precision import PRECISIONS, build_precision
from kiln.precision.amp import BF16MixedPrecision, FP16MixedPrecision
from kiln.precision.apex import ApexPrecision
from kiln.precision.base import Precision, PrecisionError
from kiln.precision.float8 import Float8Precision
from kiln.precision.fp32 import FP32Precision
from kiln.precision.half import BF16TruePrecision, FP16TruePrecision
from kiln.precision.mxfp8 import MXFP8Precision
from kiln.precision.tf32 import TF32Precision
from kiln.registry import UnknownNameError

EXPECTED = {
    "fp32": FP32Precision,
    "32": FP32Precision,
    "32-true": FP32Precision,
    "no": FP32Precision,
    "fp16": FP16MixedPrecision,
    "16-mixed": FP16MixedPrecision,
    "16": FP16MixedPrecision,
    "bf16": BF16MixedPrecision,
    "bf16-mixed": BF16MixedPrecision,
    "fp16-true": FP16TruePrecision,
    "16-true": FP16TruePrecision,
    "bf16-true": BF16TruePrecision,
    "apex": ApexPrecision,
    "tf32": TF32Precision,
    "fp8": Float8Precision,  # building it needs torchao (kiln[float8]; not in the test extra: see below)
    "float8": Float8Precision,
    "mxfp8": MXFP8Precision,  # torchao too
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_name_resolves_to_its_class(name, make_config):
    assert PRECISIONS.get(name) is EXPECTED[name]
    if EXPECTED[name] in (Float8Precision, MXFP8Precision) and importlib.util.find_spec("torchao") is None:
        # transformers imports torchao into every process that builds a model once it is installed (seconds
        # per process), so the test extra leaves it out; without it, fp8 is refused naming the extra
        with pytest.raises(Exception, match=re.escape("kiln[float8]")):
            build_precision(make_config(name=name))
        return
    plugin = build_precision(make_config(name=name))
    assert type(plugin) is EXPECTED[name]


def test_every_registered_name_is_covered():
    assert set(PRECISIONS.names()) == set(EXPECTED)


def test_names_are_case_insensitive():
    assert PRECISIONS.get("BF16") is BF16MixedPrecision


def test_unknown_name_lists_the_valid_ones(make_config):
    with pytest.raises(UnknownNameError) as err:
        build_precision(make_config(name="bf61"))
    msg = str(err.value)
    assert "'bf61'" in msg and "precision.name" in msg and "Did you mean 'bf16'" in msg
    for name in ("fp32", "fp16", "bf16", "bf16-true", "fp16-true", "apex", "tf32"):
        assert name in msg


def test_class_or_instance_override_is_accepted(make_config):
    cfg = make_config(name="fp32")
    instance = BF16MixedPrecision(cfg)
    assert build_precision(cfg, instance) is instance
    assert type(build_precision(cfg, FP16TruePrecision)) is FP16TruePrecision


@pytest.mark.parametrize("name", ["fp16", "16-mixed", "16"])
def test_fp16_with_apex_backend_builds_the_apex_plugin(name, make_config):
    plugin = build_precision(make_config(name=name, half_precision_backend="apex", fp16_opt_level="O2"))
    assert isinstance(plugin, ApexPrecision) and plugin.opt_level == "O2"


def test_bf16_with_apex_backend_is_rejected_not_swapped(make_config):
    with pytest.raises(PrecisionError, match="apex AMP is fp16-only"):
        build_precision(make_config(name="bf16", half_precision_backend="apex"))


def test_apex_name_with_a_torch_amp_backend_is_rejected(make_config):
    with pytest.raises(PrecisionError, match="contradicts half_precision_backend 'cuda_amp'"):
        build_precision(make_config(name="apex", half_precision_backend="cuda_amp"))


def test_apex_backend_leaves_non_fp16_plugins_alone(make_config):
    assert type(build_precision(make_config(name="bf16-true", half_precision_backend="apex"))) is BF16TruePrecision


def test_plugins_share_the_interface():
    for cls in set(EXPECTED.values()):
        assert issubclass(cls, Precision)
        assert cls.name in PRECISIONS


def test_dtype_seam_for_strategies():
    """FSDP / DeepSpeed read these instead of asking for a plugin type."""
    import torch

    assert (FP32Precision.compute_dtype, FP32Precision.param_dtype, FP32Precision.uses_grad_scaler) == (
        None,
        None,
        False,
    )
    assert (BF16MixedPrecision.compute_dtype, BF16MixedPrecision.param_dtype) == (torch.bfloat16, None)
    assert (FP16MixedPrecision.compute_dtype, FP16MixedPrecision.uses_grad_scaler) == (torch.float16, True)
    assert (BF16TruePrecision.param_dtype, FP16TruePrecision.param_dtype) == (torch.bfloat16, torch.float16)


def test_importing_the_registry_imports_no_plugin():
    code = (
        "import sys, kiln.precision as p; "
        "assert 'bf16' in p.PRECISIONS; "
        "loaded = [m for m in ('kiln.precision.amp', 'kiln.precision.half', 'kiln.precision.apex', "
        "'kiln.precision.tf32', 'torch', 'apex') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
