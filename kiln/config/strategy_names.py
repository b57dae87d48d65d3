"""The strategy names a config may give, each with the module that registers it.

The table sits on config's floor so that validation can refuse an unknown `strategy.name` before any
work starts without importing kiln.strategies (which imports config: the check would run up a floor).
kiln.strategies builds its registry's lazy entries from this table."""

from __future__ import annotations

import sys

from kiln.registry import Registry

#: (names, module that registers them when imported)
STRATEGY_MODULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("single", "cpu", "cuda"), "kiln.strategies.single"),
    (("ddp", "ddp_find_unused_parameters_true"), "kiln.strategies.ddp.strategy"),
    (("fsdp", "fsdp2"), "kiln.strategies.fsdp.strategy"),
    (("model_parallel",), "kiln.strategies.model_parallel.strategy"),
    (("deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_2_offload",
      "deepspeed_stage_3_offload"), "kiln.strategies.deepspeed.strategy"),
    (("xla",), "kiln.strategies.xla.strategy"),
    (("xla_fsdp",), "kiln.strategies.xla.fsdp"),
    (("mps",), "kiln.strategies.mps"),
    (("auto",), "kiln.strategies.auto"),
)


def check_strategy_name(name: str) -> None:
    """Raise UnknownNameError (with the valid names) unless `name` is a built-in strategy or one
    registered at run time. A name registered at run time (`@STRATEGIES.register("mine")`) lives only
    in the loaded registry, which exists only if its registering code imported kiln.strategies, so
    reading it from sys.modules finds every such name without importing anything."""
    names: Registry[type] = Registry("strategy", "strategy.name")
    for group, module in STRATEGY_MODULES:
        for entry in group:
            names.add_lazy(entry, module)
    loaded = sys.modules.get("kiln.strategies")
    for entry in getattr(loaded, "STRATEGIES", ()):
        names.add_lazy(entry, "")
    names.check(name)
