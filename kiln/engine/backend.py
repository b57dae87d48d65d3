"""The strategy and precision plugin a Trainer runs on, built from the config (or taken as given) in the
order they depend on each other: the precision plugin, the strategy (which decides where, and how sharded,
a model the Trainer builds lives), the process environment and log levels, then the plugin connected to
the strategy and checked against its device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.engine.distributed import configure_logging
from kiln.precision import build_precision
from kiln.strategies import adopt_model, build_strategy, check_run_compatible

if TYPE_CHECKING:
    from torch import nn

    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy


def build_backend(
    config: Any, model: nn.Module | None, strategy: Any, precision: Any, *, user_optimizer: bool
) -> tuple[Any, Strategy, Precision]:
    """(config, strategy, precision plugin); `strategy` / `precision` are the Trainer's arguments: None, a
    name's class, or an instance. The config is `config`, or a new one whose strategy a model transformers
    split at load settled (kiln.strategies.adopt_model): the Trainer keeps the one returned."""
    precision = (
        precision if precision is not None and not isinstance(precision, type) else build_precision(config, precision)
    )
    config = adopt_model(config, model)  # a model transformers split at load picks its strategy, as in HF's Trainer
    built = build_strategy(config, precision, strategy)
    check_run_compatible(built, precision, config, user_optimizer=user_optimizer)
    built.setup_environment()
    configure_logging(config, built)  # log.level on the main process, log.level_replica elsewhere
    precision = built.connect_precision(precision)
    precision.check_device(built.root_device)
    return config, built, precision
