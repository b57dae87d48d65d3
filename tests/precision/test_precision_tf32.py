"""TF32 flags: set for the run, restored exactly afterwards (the flag handling itself, on any
machine), and `tf32: true` rejected before training where TF32 does not exist."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.precision.amp import BF16MixedPrecision
from kiln.precision.base import PrecisionError
from kiln.precision.fp32 import FP32Precision
from kiln.precision.half import BF16TruePrecision
from kiln.precision.tf32 import TF32Precision
from kiln.precision.tf32_flags import restore_tf32, set_tf32, tf32_state

b = torch.backends


def _legacy() -> tuple[bool, bool]:
    return b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32


@pytest.mark.parametrize("enabled", [True, False])
def test_set_tf32_changes_the_flags_and_restore_puts_back_the_exact_values(enabled):
    before_state, before = tf32_state(), _legacy()
    saved = set_tf32(enabled)
    assert _legacy() == (enabled, enabled)
    if hasattr(b.cuda.matmul, "fp32_precision"):
        assert b.cuda.matmul.fp32_precision == ("tf32" if enabled else "ieee")
    assert saved == before_state
    restore_tf32(saved)
    assert _legacy() == before
    assert tf32_state() == before_state


def test_tf32_state_covers_both_apis():
    state = tf32_state()
    assert {"cuda.matmul.allow_tf32", "cudnn.allow_tf32", "float32_matmul_precision"} <= set(state)
    if hasattr(b.cuda.matmul, "fp32_precision"):
        assert {"cuda.matmul.fp32_precision", "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision"} <= set(state)


def test_set_tf32_leaves_cpu_matmul_precision_alone():
    """tf32 is a CUDA setting: it must not switch oneDNN to reduced precision on the CPU."""
    before = tf32_state()
    saved = set_tf32(True)
    try:
        for key in ("mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision"):
            assert tf32_state().get(key) == before.get(key)
    finally:
        restore_tf32(saved)


def _user_on_new_api() -> None:
    b.cuda.matmul.fp32_precision = "tf32"
    b.cudnn.conv.fp32_precision = "ieee"


def _global_ieee() -> None:
    b.fp32_precision = "ieee"


def _medium() -> None:
    torch.set_float32_matmul_precision("medium")


def _check_roundtrip_from(initial) -> None:
    initial()
    for enabled in (True, False):
        before = tf32_state()
        saved = set_tf32(enabled)
        assert tf32_state()["cuda.matmul.fp32_precision"] == ("tf32" if enabled else "ieee")
        restore_tf32(saved)
        assert tf32_state() == before, (before, tf32_state())


def _run_in_fork(fn, *args) -> str:
    """Run `fn` in a forked copy of this process (torch already imported, flags untouched here);
    returns "" on success or the child's error. The newer fp32_precision API cannot be fully undone
    in-process, so these cases must not run in the test process itself."""
    import os
    import traceback

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        try:
            fn(*args)
            message = b""
        except BaseException:  # noqa: BLE001 - everything must reach the parent
            message = traceback.format_exc().encode() or b"failed"
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


@pytest.mark.skipif(not hasattr(b.cuda.matmul, "fp32_precision"), reason="torch without the fp32_precision API")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("initial", [_user_on_new_api, _global_ieee, _medium], ids=lambda f: f.__name__)
def test_restore_is_exact_from_other_initial_states(initial):
    assert _run_in_fork(_check_roundtrip_from, initial) == ""


# -- through the plugins -------------------------------------------------------------------
@pytest.mark.parametrize("cls", [FP32Precision, BF16MixedPrecision, BF16TruePrecision])
def test_every_plugin_applies_tf32_in_setup_and_restores_in_teardown(cls, make_config):
    before_state, before = tf32_state(), _legacy()
    plugin = cls(make_config(tf32=True))
    plugin.setup()
    plugin.setup()  # idempotent: the second call must not overwrite the saved flags
    assert _legacy() == (True, True)
    plugin.teardown()
    assert _legacy() == before and tf32_state() == before_state
    plugin.teardown()  # nothing left to restore
    assert tf32_state() == before_state


def test_tf32_false_forbids_tf32_for_the_run(make_config):
    before = tf32_state()
    plugin = FP32Precision(make_config(tf32=False))
    plugin.setup()
    assert _legacy() == (False, False)
    plugin.teardown()
    assert tf32_state() == before


def test_tf32_unset_touches_nothing(make_config):
    before = tf32_state()
    plugin = BF16MixedPrecision(make_config())
    assert plugin.tf32 is None
    plugin.setup()
    assert tf32_state() == before
    plugin.teardown()


def test_tf32_name_means_fp32_with_tf32(make_config):
    plugin = TF32Precision(make_config())
    assert plugin.tf32 is True and plugin.compute_dtype is None
    before = tf32_state()
    plugin.setup()
    assert _legacy() == (True, True)
    plugin.teardown()
    assert tf32_state() == before


def test_tf32_name_with_tf32_false_is_a_contradiction(make_config):
    with pytest.raises(PrecisionError, match="precision is 'tf32' but precision.tf32 is false"):
        TF32Precision(make_config(name="tf32", tf32=False))


@pytest.mark.parametrize("cls", [FP32Precision, BF16MixedPrecision, TF32Precision])
def test_tf32_true_is_rejected_on_cpu(cls, make_config):
    with pytest.raises(PrecisionError) as err:
        cls(make_config(tf32=True if cls is not TF32Precision else None)).check_device(torch.device("cpu"))
    msg = str(err.value)
    assert "precision.tf32 is true" in msg and "Ampere or newer GPUs" in msg and "'cpu'" in msg
    assert "remove tf32" in msg


def test_tf32_false_is_accepted_on_cpu(make_config):
    FP32Precision(make_config(tf32=False)).check_device(torch.device("cpu"))


def test_tf32_on_a_pre_ampere_gpu_is_rejected(make_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(PrecisionError, match="compute capability >= 8.0.*Tesla V100-SXM2-16GB has 7.0"):
        FP32Precision(make_config(tf32=True)).check_device(torch.device("cuda", 0))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8, reason="needs an Ampere+ GPU"
)
def test_tf32_on_an_ampere_gpu_is_accepted_and_changes_matmuls(make_config):
    plugin = FP32Precision(make_config(tf32=True))
    plugin.check_device(torch.device("cuda", 0))
    a = torch.randn(1024, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    exact = a @ a
    plugin.setup()
    try:
        fast = a @ a
    finally:
        plugin.teardown()
    assert not torch.equal(fast, exact)  # TF32 rounds the inputs to 10 mantissa bits
    torch.testing.assert_close(fast, exact, rtol=1e-2, atol=1e-1)
    assert torch.equal(a @ a, exact)  # and the flags are back
