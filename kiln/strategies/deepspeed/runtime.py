"""Talking to the `deepspeed` package: importing it (or one sentence on how to install it), its C++ ops' JIT
compilation (a missing compiler or ninja becomes one sentence), creating its process group without the op
training never uses, and telling its engine and partitioned parameters apart (deepspeed ships no types)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeGuard

from torch import nn

from kiln.utils.errors import ConfigError


def import_deepspeed() -> Any:
    """deepspeed, or one sentence saying how to install it."""
    try:
        import deepspeed
    except ImportError:
        raise ConfigError("strategy 'deepspeed' needs the deepspeed package: pip install kiln[deepspeed].") from None
    return deepspeed


def is_engine(model: Any) -> TypeGuard[Any]:  # a DeepSpeedEngine (deepspeed ships no types)
    return hasattr(model, "set_gradient_accumulation_boundary") and hasattr(model, "module")


def inner_model(module: nn.Module) -> nn.Module:
    """The user's model inside kiln's StepDispatcher (for its `config.hidden_size`)."""
    return module if hasattr(module, "config") else getattr(module, "module", module)


def partitioned(module: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


@contextlib.contextmanager
def without_shm_comm_op(deepspeed: Any) -> Iterator[None]:
    """On the CPU accelerator `init_distributed` JIT-compiles DeepSpeed's shared-memory all-reduce
    (`deepspeed_shm_comm`, ~150-200 s on a fresh 2-core machine, before any message). Only
    `inference_all_reduce` (AutoTP inference) uses it, never training, which falls back to
    torch.distributed without it; so it is marked unavailable while the backend is created."""
    ops = getattr(deepspeed.ops, "__compatible_ops__", None)  # probed once by DeepSpeed (cheap), then cached
    if deepspeed.get_accelerator().device_name() != "cpu" or not isinstance(ops, dict):
        yield
        return
    before = ops.get("deepspeed_shm_comm", False)
    ops["deepspeed_shm_comm"] = False
    try:
        yield
    finally:
        ops["deepspeed_shm_comm"] = before


def compiling(call: Any) -> Any:
    """Run a DeepSpeed call that may JIT-compile a C++ op; a missing compiler or ninja becomes one
    sentence naming the package to install."""
    import subprocess

    try:
        return call()
    except (subprocess.CalledProcessError, FileNotFoundError, RuntimeError) as err:
        text = str(err)
        if "ninja" in text.lower():
            raise ConfigError("DeepSpeed JIT-compiles its C++ ops and needs ninja: pip install ninja.") from None
        if (
            isinstance(err, (subprocess.CalledProcessError, FileNotFoundError))
            or "c++" in text.lower()
            or "compiler" in text.lower()
        ):
            raise ConfigError(
                "DeepSpeed JIT-compiles its C++ ops and found no working C++ compiler: install g++ "
                f"(apt-get install g++) or set CXX ({text.splitlines()[0] if text else type(err).__name__})."
            ) from None
        raise


def release_engine_groups(engine: Any) -> None:
    """Drop a DeepSpeed engine's holds on the process groups (see destroy_default_group): on gloo only a
    freed group closes its connections, which is what stops the peers when a fit fails (strategy.abort).
    The engine cannot be dropped instead: the failing fit's traceback still holds it. DeepSpeed spreads the
    groups over the engine, its ZeRO optimizer and parameter coordinator, zero.Init's object (reached
    through the closures it puts on each parameter) and, under ZeRO-3, every parameter (`ds_process_group`),
    so every object reachable from the engine through DeepSpeed's objects and the parameters lets go of any
    group it holds. The engine cannot run afterwards; nor could it, with its group destroyed."""
    from torch.distributed import ProcessGroup

    def holds_group(value: Any) -> bool:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
        return isinstance(value, ProcessGroup) or any(isinstance(v, ProcessGroup) for v in items)

    seen: set[int] = set()
    todo = [engine, *engine.module.parameters()]
    while todo:
        obj = todo.pop()
        attrs = getattr(obj, "__dict__", None)
        if id(obj) in seen or not isinstance(attrs, dict):
            continue
        seen.add(id(obj))
        for name, value in list(attrs.items()):
            if holds_group(value):
                attrs[name] = None
                continue
            cells = getattr(value, "__closure__", None) or ()  # zero.Init's per-parameter functions
            for found in (value, *(c.cell_contents for c in cells if c.cell_contents is not None)):
                if type(found).__module__.startswith("deepspeed."):
                    todo.append(found)
