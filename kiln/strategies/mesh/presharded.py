"""A model transformers distributed at load (`from_pretrained(..., tp_plan="auto")`, or
`distributed_config=DistributedConfig(tp_size=N)`): its layers are already DTensors on transformers' own
mesh, so the strategy must neither broadcast its weights nor parallelise it again. HF's Trainer reads the
same facts (`model.tp_size`, `model.config.distributed_config`, trainer.py) to give accelerate a
ParallelismConfig; kiln picks `model_parallel` with `mesh: {tp: N}` for it, as it would for the same model
loaded whole with `tp_plan: auto`.

Such a run is tensor parallel only (the world is the tp size): transformers' own FSDP, replica, pipeline
and expert axes are refused, and kiln adds no data-parallel axes of its own, since FSDP2 over a TP model
needs both meshes cut from one parent and transformers' mesh is not kiln's. To combine TP with data
parallelism, load the model whole and give kiln the mesh with `tp_plan: auto`."""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.utils.errors import ConfigError

#: transformers' DistributedConfig sizes kiln cannot take over from a loaded model (its own FSDP / HSDP / PP / EP)
_OTHER_AXES = ("fsdp_size", "dp_replicate_size", "pp_size", "ep_size")


def loaded_tp_size(model: nn.Module | None) -> int | None:
    """N for a model transformers distributed with tensor parallelism N at load; None for any other model."""
    if model is None or not is_loaded_split(model):
        return None
    config: Any = getattr(getattr(model, "config", None), "distributed_config", None)
    name = type(model).__name__
    sizes = {axis: getattr(config, axis, 1) for axis in _OTHER_AXES}  # ints in transformers' DistributedConfig
    other = [f"{axis} {size}" for axis, size in sizes.items() if size > 1]
    if other:
        raise ConfigError(
            f"{name} was distributed by transformers at load with {', '.join(other)}; kiln takes over "
            "only the tensor parallelism of such a load: load the model whole and set strategy "
            "model_parallel with mesh (dp_shard, dp_replicate, tp) and tp_plan: auto instead."
        )
    return int(getattr(model, "tp_size", None) or config.tp_size)  # the model's, else its DistributedConfig's


def adopt_loaded_model(config: Any, model: nn.Module | None, world_size: int) -> Any:
    """`config` (read-only once loaded) as it is, or, for a model transformers split at load, a new config
    whose `strategy` is model_parallel over the model's tp size (from strategy auto, or model_parallel with
    no mesh or the same one); a strategy or mesh that cannot train it is refused in one sentence."""
    tp = loaded_tp_size(model)
    if tp is None:
        return config
    name, options = config.strategy.name, config.strategy.options
    given = options.get("mesh") if options is not None else None
    what = f"{type(model).__name__} was split by transformers at load (tensor parallelism {tp})"
    if name not in ("auto", "model_parallel"):
        raise ConfigError(
            f"{what}; strategy {name!r} cannot train a model whose layers are already DTensors: use "
            "strategy auto or model_parallel (or load the model without tp_plan / distributed_config)."
        )
    if world_size != tp:
        raise ConfigError(
            f"{what} and this run has {world_size} processes; a loaded model trains with tensor "
            f"parallelism only, so start {tp} processes (or load it whole and give kiln the whole mesh)."
        )
    if given is not None and {axis: size for axis, size in dict(given).items() if size != 1} != {"tp": tp}:
        raise ConfigError(f"{what}, and strategy.mesh is {dict(given)}; drop strategy.mesh or set it to {{tp: {tp}}}.")
    if options is not None and options.get("tp_plan") is not None:
        raise ConfigError(f"{what}, and strategy.tp_plan would split it again; drop strategy.tp_plan.")
    from omegaconf import OmegaConf

    from kiln.config.load import load_config

    plain: Any = OmegaConf.to_container(config, resolve=True)
    plain["strategy"]["name"] = "model_parallel"
    plain["strategy"]["options"]["mesh"] = {"tp": tp}  # replaced whole: a given mesh may spell the axes of size 1
    return load_config(plain)


def is_loaded_split(module: nn.Module) -> bool:
    """The module was split by transformers at load (the flag `from_pretrained` sets on the model it distributes;
    a TrainingModule holding such a model is not recognised)."""
    return bool(getattr(module, "_is_distributed_loading_by_transformers", False))
