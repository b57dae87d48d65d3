"""Strategies, chosen by name (`strategy: ddp`). Each file registers its own names; files are
imported only when a config names them, so optional packages stay unimported until needed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.config.names import STRATEGY_GROUPS
from kiln.registry import Registry, publish

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy

STRATEGIES: Registry[type] = publish(Registry("strategy", "strategy.name"))

#: each group of names in config's vocabulary (kiln.config.names) -> the module that registers it
STRATEGY_MODULES: dict[tuple[str, ...], str] = dict(
    zip(
        STRATEGY_GROUPS,
        (
            "kiln.strategies.single",
            "kiln.strategies.ddp.strategy",
            "kiln.strategies.fsdp.strategy",
            "kiln.strategies.model_parallel.strategy",
            "kiln.strategies.deepspeed.strategy",
            "kiln.strategies.xla.strategy",
            "kiln.strategies.xla.fsdp",
            "kiln.strategies.mps",
            "kiln.strategies.auto",
        ),
        strict=True,
    )
)

for _names, _module in STRATEGY_MODULES.items():
    for _name in _names:
        STRATEGIES.add_lazy(_name, _module)


def build_strategy(config: DictConfig, precision: Precision, override: Any = None) -> Strategy:
    """Instantiate the strategy the config names; `override` may be a Strategy class or instance (a name
    given to the Trainer is the config's `strategy.name` by then: kiln.engine.arguments.pop_objects)."""
    from kiln.strategies.base import Strategy

    if isinstance(override, Strategy):
        return override
    cls = override if isinstance(override, type) else STRATEGIES.get(config.strategy.name)
    resolve = getattr(cls, "resolve", None)
    if resolve is not None:
        cls = resolve(config)  # `auto` and `xla_fsdp` pick a concrete class from the config
    return cls(config, precision)


def adopt_model(config: DictConfig, model: Any) -> DictConfig:
    """The config the strategy is built from, settled by the model the Trainer was given: `config` itself,
    or for a model transformers split at load (`from_pretrained(tp_plan=...)`) a new config naming
    model_parallel over its tp size (the loaded config is read-only; the Trainer keeps the new one, so a
    checkpoint's config.yaml names the strategy that ran). A strategy that cannot train such a model is
    refused (HF's Trainer reads `model.tp_size` likewise)."""
    if model is not None and getattr(model, "_is_distributed_loading_by_transformers", False):
        import torch.distributed as dist

        from kiln.launch.environment import detect
        from kiln.strategies.mesh.presharded import adopt_loaded_model

        # transformers started the process group to split the model; the launcher's reading otherwise
        world_size = dist.get_world_size() if dist.is_initialized() else detect().world_size
        return adopt_loaded_model(config, model, world_size)
    return config


def check_run_compatible(strategy: Strategy, precision: Precision, config: DictConfig, *, user_optimizer: bool) -> None:
    """Refuse an impossible strategy x precision x device x options combination before any process
    group starts (see kiln.strategies.capabilities)."""
    from kiln.config.compile import compiles_model
    from kiln.strategies.capabilities import check_compatible

    check_compatible(
        strategy.name,
        type(strategy).capabilities,
        precision=precision.name,
        device=strategy.root_device,
        full_eval=precision.eval_dtype is not None,
        auto_batch_size=bool(config.data.auto_find_batch_size),
        user_optimizer=user_optimizer,
        torch_compile=compiles_model(config),
    )
