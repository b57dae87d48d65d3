"""The contract a strategy class must meet when it is created and registered, checked without
training: collectives have no identity default, the optional interfaces are real ABCs, and the
checkpoint formats a strategy declares are in the format registry with a way to consolidate them;
and the base class's defaults a strategy inherits (declared options read from the config, zero_grad)."""

from __future__ import annotations

import pytest
import torch

from kiln.registry import UnknownNameError
from kiln.strategies import STRATEGIES
from kiln.strategies.base import COLLECTIVES, SingleProcessCollectives, Strategy
from kiln.strategies.checkpoint_io import FORMATS, CheckpointIO
from kiln.strategies.ddp.strategy import DDPStrategy
from kiln.strategies.interfaces import BackwardSyncControl


@pytest.mark.parametrize("missing", COLLECTIVES)
def test_a_multi_process_strategy_missing_a_collective_is_refused_at_class_creation(missing):
    body = {name: (lambda self, *a, **k: None) for name in COLLECTIVES if name != missing}
    with pytest.raises(
        TypeError, match=rf"does not implement the collective\(s\) {missing}\b.*SingleProcessCollectives"
    ):
        type("Forgetful", (Strategy,), body)


def test_every_collective_defined_or_the_single_process_mixin_is_accepted():
    type("Complete", (Strategy,), {name: (lambda self, *a, **k: None) for name in COLLECTIVES})
    one = type("OneProcess", (SingleProcessCollectives, Strategy), {})
    assert one.reduce(None, torch.ones(2)).tolist() == [1.0, 1.0]
    assert one.all_gather(None, torch.ones(2)).shape == (1, 2)  # one rank's entry along a new first dimension
    assert one.all_gather_object(None, "a") == ["a"] and one.broadcast_object(None, "a") == "a"


def test_the_mixin_after_strategy_does_not_count():
    """Strategy's stubs come first in that MRO, so the identity versions would never be reached."""
    with pytest.raises(TypeError, match="listed before Strategy"):
        type("WrongOrder", (Strategy, SingleProcessCollectives), {})


def test_a_subclass_of_a_multi_process_strategy_inherits_its_collectives():
    sub = type("MyDDP", (DDPStrategy,), {})
    assert sub.all_gather is DDPStrategy.all_gather and issubclass(sub, BackwardSyncControl)


def test_an_optional_interface_must_be_implemented_to_be_claimed():
    half = type("Claims", (SingleProcessCollectives, Strategy, BackwardSyncControl), {})
    with pytest.raises(TypeError, match="micro_batch_context"):
        half(None, None)


def _strategy_classes() -> list[type]:
    out = []
    for name in STRATEGIES.names():
        try:
            cls = STRATEGIES.get(name)
        except (UnknownNameError, ImportError):
            continue
        if hasattr(cls, "checkpoint_formats") and cls not in out:  # a strategy, or a chooser (xla_fsdp) declaring them
            out.append(cls)
    return out


@pytest.mark.parametrize("cls", _strategy_classes(), ids=lambda c: c.name)
def test_declared_checkpoint_formats_are_registered_and_consolidate(cls):
    assert cls.checkpoint_formats, f"{cls.name} declares no checkpoint format"
    for fmt in cls.checkpoint_formats:
        io = FORMATS.get(fmt)
        assert io.format == fmt
        assert io.consolidate.__func__ is not CheckpointIO.consolidate.__func__, f"{fmt} cannot be consolidated"


def test_every_builtin_format_names_its_own_class():
    for fmt in ("full", "fsdp-full", "fsdp-sharded", "xla-full", "xla-spmd-sharded", "xla-fsdp-classic", "deepspeed"):
        assert FORMATS.get(fmt).format == fmt


def test_a_strategy_that_cannot_be_compiled_refuses_torch_compile_from_the_config():
    """Declared as data (Capabilities.torch_compile + its reason), checked before anything starts."""
    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies import check_run_compatible
    from kiln.strategies.capabilities import Capabilities
    from kiln.strategies.single import SingleDeviceStrategy
    from kiln.utils.errors import CapabilityError

    class Uncompilable(SingleDeviceStrategy):
        name = "uncompilable"
        capabilities = Capabilities(torch_compile=False, reasons={"torch_compile": "it compiles itself"})

    for compiles in ({"torch_compile": True}, {"torch_compile_backend": "eager"}):
        cfg = load_config({"strategy": {"device": "cpu"}, **compiles})
        strategy = Uncompilable(cfg, build_precision(cfg))
        with pytest.raises(
            CapabilityError,
            match=r"^torch_compile cannot be used with strategy 'uncompilable': it compiles "
            r"itself; drop torch_compile\.$",
        ):
            check_run_compatible(strategy, strategy.precision, cfg, user_optimizer=False)
    cfg = load_config({"strategy": {"device": "cpu"}})
    check_run_compatible(Uncompilable(cfg, build_precision(cfg)), build_precision(cfg), cfg, user_optimizer=False)


def test_a_declared_option_is_read_from_the_config_and_falls_back_to_its_default():
    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies.single import SingleDeviceStrategy

    class Deep(SingleDeviceStrategy):
        name = "deep"
        options = {"depth": "how deep", "width": "how wide"}

    cfg = load_config({"strategy": {"device": "cpu", "options": {"depth": 3}}})
    strategy = Deep(cfg, build_precision(cfg))
    assert strategy.option("depth") == 3 and strategy.option("depth", 5) == 3
    assert strategy.option("width", 8) == 8 and strategy.option("width") is None


def test_the_default_zero_grad_frees_the_gradients_as_hf_does():
    """set_to_none: the memory goes back, and a parameter without a gradient next step is skipped by the
    optimizer (a zero gradient would still get Adam's momentum and weight decay)."""
    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies.single import SingleDeviceStrategy

    cfg = load_config({"strategy": {"device": "cpu"}})
    strategy = SingleDeviceStrategy(cfg, build_precision(cfg))
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    strategy.zero_grad(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert [p.grad for p in model.parameters()] == [None, None]
