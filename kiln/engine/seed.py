"""Seeding and RNG state capture, so two runs with one config are identical and a resumed run
continues every random stream (python, numpy, torch CPU, and each accelerator's: CUDA, MPS, XLA)
exactly where it stopped. Device streams go through `kiln.accelerators`."""

from __future__ import annotations

import random
from typing import Any, cast

import torch


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); `deterministic` is HF's full_determinism."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for kiln itself
        pass
    torch.manual_seed(seed)
    from kiln.accelerators import available_accelerators

    for accelerator in available_accelerators():
        accelerator.manual_seed(seed)
    if deterministic:
        enable_full_determinism()


def enable_full_determinism() -> None:
    # cuBLAS reads this when its handle is created, so it must be set before the first matmul.
    from kiln.launch.environment.variables import export_default

    export_default("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this process, as plain tensors/lists (loadable with weights_only=True)."""
    state: dict[str, Any] = {"python": _py_state_to_plain(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        # numpy's global RandomState is MT19937, whose legacy state is this tuple (never the dict form)
        legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    except ImportError:
        pass
    from kiln.accelerators import available_accelerators

    for accelerator in available_accelerators():  # saved under the device kind: "cuda", "mps", "xla"
        device_state = accelerator.rng_state()
        if device_state is not None:
            state[accelerator.name] = device_state
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_py_state_from_plain(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    from kiln.accelerators import available_accelerators

    for accelerator in available_accelerators():
        if accelerator.name in state:
            accelerator.set_rng_state(state[accelerator.name])


def _py_state_to_plain(st: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = st
    return [version, list(internal), gauss]


def _py_state_from_plain(plain: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = plain
    return (version, tuple(internal), gauss)
