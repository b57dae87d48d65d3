"""What the newest mesh axes (pp, ep) do not run with yet, refused in one sentence before any process group
starts: the settings both axes leave out, and the sentence that names the ones a config turned on."""

from __future__ import annotations

from typing import Any

from kiln.utils.errors import ConfigError


def unsupported_settings(s: Any, config: Any) -> dict[str, bool]:
    """The settings neither pp nor ep runs with, by the name the refusal gives them -> whether they are on."""
    settings = {
        "offload": s.offload,
        "cpu_ram_efficient_loading": s.cpu_ram_efficient_loading,
        # the strategy's alias (`activation_checkpointing: true`) or the config's section (mode full or selective)
        "activation_checkpointing": s.activation_checkpointing or _checkpointing_mode(config) is not None,
        # beside tp, each axis splits by the model's own plan (auto); a mapping would name layers a pp stage
        # does not hold, or ep's experts
        "tp_plan as a mapping (the model's own plan, auto, runs beside tp)": s.tp_plan not in (None, "auto"),
        "state_dict_type: full": s.state_dict_type == "full",
    }
    if config is not None:
        train = config.train
        settings["train.torch_compile"] = bool(
            train.torch_compile or train.torch_compile_backend or train.torch_compile_mode
        )
        settings["train.gradient_checkpointing"] = bool(train.gradient_checkpointing)
    return settings


def _checkpointing_mode(config: Any) -> Any:
    """The config's `activation_checkpointing.mode` (None: off, or a config without the section)."""
    section = None if config is None else getattr(config, "get", lambda key: None)("activation_checkpointing")
    return None if section is None else section.get("mode")


def refuse(axis: str, size: int, settings: dict[str, bool]) -> None:
    """One sentence naming every setting that is on, or nothing."""
    refused = [key for key, on in settings.items() if on]
    if refused:
        raise ConfigError(
            f"strategy.mesh.{axis} {size} does not run with {', '.join(refused)} yet; drop "
            f"{'it' if len(refused) == 1 else 'them'}, or drop {axis}."
        )
