"""What `train.torch_compile*` and the `torch_compile` section ask torch.compile to do, read in one place:
the engine compiles the set-up module (or its optimizer step) with it, and a strategy that compiles per
block (FSDP2, or any strategy with `torch_compile: {regions: blocks}`) reads the same settings, so the two
cannot disagree on the default backend.

On the config floor because strategies and the engine both read it (imports only go down)."""

from __future__ import annotations

from typing import Any

from kiln.utils.errors import ConfigError

#: torch.compile's modes (`torch._inductor.list_mode_options()` keys, plus "default")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

#: `torch_compile.regions`: what is compiled as one region (unset: the whole model)
REGIONS = ("blocks",)


def compiles_model(config: Any) -> bool:
    """Whether the module is compiled: `train.torch_compile`, or a backend, a mode or `torch_compile.regions`
    (which imply it, as a backend or a mode do in HF)."""
    if config is None:
        return False
    train = config.train
    return bool(
        train.torch_compile or train.torch_compile_backend or train.torch_compile_mode or config.torch_compile.regions
    )


def compiles_blocks(config: Any) -> bool:
    """Whether each repeated block is compiled on its own (`torch_compile: {regions: blocks}`)."""
    return config is not None and config.torch_compile.regions == "blocks"


def compile_kwargs(train: Any) -> dict[str, Any]:
    """torch.compile's keyword arguments for this run (inductor unless a backend is named)."""
    return {"backend": train.torch_compile_backend or "inductor", "mode": train.torch_compile_mode}


def model_compile_kwargs(config: Any) -> dict[str, Any] | None:
    """`compile_kwargs` when the module is compiled, else None."""
    return compile_kwargs(config.train) if compiles_model(config) else None


def check_regions(regions: str | None) -> None:
    """A region name torch.compile's wrapping would not know is refused at load, not at the first forward."""
    if regions is not None and regions not in REGIONS:
        raise ConfigError(
            f"Config key 'torch_compile.regions' is {regions!r}; use blocks (each repeated block compiled once) "
            "or leave it unset (the whole model)."
        )


def check_compile_mode(mode: str | None) -> None:
    """torch.compile rejects an unknown mode only at the first forward, after the model and data were built."""
    if mode is not None and mode not in COMPILE_MODES:
        raise ConfigError(
            f"Config key 'train.torch_compile_mode' is {mode!r}, which torch.compile does not know; "
            f"choose one of {', '.join(COMPILE_MODES)}."
        )
