"""What `train.torch_compile*` asks torch.compile to do, read in one place: the engine compiles the
set-up module (or its optimizer step) with it, and a strategy that compiles per block (FSDP2) reads
the same settings, so the two cannot disagree on the default backend.

On the config floor because strategies and the engine both read it (imports only go down)."""

from __future__ import annotations

from typing import Any

from kiln.utils.errors import ConfigError

#: torch.compile's modes (`torch._inductor.list_mode_options()` keys, plus "default")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compiles_model(train: Any) -> bool:
    """Whether the module is compiled: `torch_compile`, or a backend or mode (which imply it, as in HF)."""
    return bool(train is not None and (train.torch_compile or train.torch_compile_backend or train.torch_compile_mode))


def compile_kwargs(train: Any) -> dict[str, Any]:
    """torch.compile's keyword arguments for this run (inductor unless a backend is named)."""
    return {"backend": train.torch_compile_backend or "inductor", "mode": train.torch_compile_mode}


def model_compile_kwargs(train: Any) -> dict[str, Any] | None:
    """`compile_kwargs` when the module is compiled, else None."""
    return compile_kwargs(train) if compiles_model(train) else None


def check_compile_mode(mode: str | None) -> None:
    """torch.compile rejects an unknown mode only at the first forward, after the model and data were built."""
    if mode is not None and mode not in COMPILE_MODES:
        raise ConfigError(
            f"Config key 'train.torch_compile_mode' is {mode!r}, which torch.compile does not know; "
            f"choose one of {', '.join(COMPILE_MODES)}."
        )
