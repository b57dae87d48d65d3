"""Optimizers picked by Hugging Face `optim` name, and the decay / no-decay parameter groups they get.

An HF user's `optim: adamw_torch, weight_decay: 0.01` must mean the same optimizer and the same
parameters decayed here, so names and argument mapping follow `transformers.Trainer`. Each registry
entry is a small factory `OptimConfig -> (optimizer class, keyword arguments)`; `build_optimizer` adds
the parameter groups and the user's `optim_args`, so a new optimizer is one registry line
(`OPTIMIZERS.add("lion", lambda cfg: (Lion, {"lr": cfg.lr}))`).

The learning-rate schedules live in `kiln.optim.schedulers`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kiln.config.schema.optim import OptimConfig
from kiln.optim import lomo as _lomo
from kiln.optim import package_optimizers as _package_optimizers
from kiln.registry import Registry, publish
from kiln.utils.kernels import mixes_meshes

logger = logging.getLogger(__name__)

__all__ = [
    "OPTIMIZERS",
    "build_optimizer",
    "decay_parameter_names",
    "is_norm_module",
    "optimizer_mode",
    "parameter_groups",
    "parse_optim_args",
]

OptimizerFactory = Callable[[OptimConfig], "tuple[type[torch.optim.Optimizer], dict[str, Any]]"]
OPTIMIZERS: Registry[OptimizerFactory] = publish(Registry("optimizer", "optim.name"))

# Where an optimizer argument comes from when it is not in optim_args: setting it there as well would
# give two sources of truth, so that is an error pointing at the config field.
_FROM_CONFIG = {
    "params": "the model",
    "lr": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "betas": "optim.adam_beta1 / optim.adam_beta2",
    "eps": "optim.adam_epsilon",
}


# ----------------------------------------------------------------------------- optimizer factories


def _adam_kwargs(cfg: OptimConfig) -> dict[str, Any]:
    return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}


def _torch_optimizer(cls: type[torch.optim.Optimizer], adam: bool = False, **fixed: Any) -> OptimizerFactory:
    """A factory for a torch.optim class: Adam-family ones take betas/eps from the config, the rest only lr."""

    def factory(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        return cls, {**(_adam_kwargs(cfg) if adam else {"lr": cfg.lr}), **fixed}

    return factory


OPTIMIZERS.add("adamw_torch", _torch_optimizer(torch.optim.AdamW, adam=True))
OPTIMIZERS.add("adamw_hf", OPTIMIZERS.get("adamw_torch"))  # HF's own AdamW is gone; it means torch's now
OPTIMIZERS.add("adamw_torch_fused", _torch_optimizer(torch.optim.AdamW, adam=True, fused=True))
OPTIMIZERS.add("adamw_torch_foreach", _torch_optimizer(torch.optim.AdamW, adam=True, foreach=True))
OPTIMIZERS.add("adam", _torch_optimizer(torch.optim.Adam, adam=True))
OPTIMIZERS.add("sgd", _torch_optimizer(torch.optim.SGD))
OPTIMIZERS.add("adagrad", _torch_optimizer(torch.optim.Adagrad))
OPTIMIZERS.add("rmsprop", _torch_optimizer(torch.optim.RMSprop))
OPTIMIZERS.add("adafactor", _torch_optimizer(torch.optim.Adafactor))


def _import(module: str, install: str, name: str) -> Any:
    """Import an optional package, or say which `pip install` makes optimizer `name` work."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"Optimizer {name!r} (`optim.name`) needs {module.split('.')[0]}: {install}.") from None


@OPTIMIZERS.register("adamw_torch_xla")
def _adamw_torch_xla(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """torch_xla's sync-free AdamW, which avoids a host sync per step on TPU."""
    syncfree = _import("torch_xla.amp.syncfree", "pip install kiln[xla]", "adamw_torch_xla")
    return syncfree.AdamW, _adam_kwargs(cfg)


def _bitsandbytes(name: str) -> OptimizerFactory:
    """bitsandbytes' 8-bit / paged AdamW, Lion and RMSprop, with HF's argument mapping."""

    def factory(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        bnb = _import("bitsandbytes.optim", "pip install bitsandbytes, or use optim.name=adamw_torch", name)
        bits = {"optim_bits": 8 if "8bit" in name else 32}
        if "rmsprop" in name:
            return bnb.RMSprop, {"lr": cfg.lr, **bits}
        paged = {**bits, "is_paged": "paged" in name}
        if "lion" in name:
            return bnb.Lion, {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), **paged}
        return bnb.AdamW, {**_adam_kwargs(cfg), **paged}

    return factory


for _name in (
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "lion_32bit",
    "lion_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
):
    OPTIMIZERS.add(_name, _bitsandbytes(_name))


def _unsupported(name: str, instead: str) -> OptimizerFactory:
    def factory(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        raise ValueError(f"Optimizer {name!r} (`optim.name`) is not supported by kiln; {instead}.")

    return factory


_USE_ADAMW = "use adamw_torch_fused or adamw_torch"
for _name, _instead in {
    "adamw_apex_fused": "use adamw_torch_fused (torch's fused AdamW kernel)",
    "adamw_torch_npu_fused": _USE_ADAMW,
    "adamw_anyprecision": _USE_ADAMW + " with precision bf16-true",
    # these step each parameter inside a per-parameter hook of their own, which leaves nothing for kiln's
    # step (accumulation, clipping, the precision plugin's inf check) to do (LOMO: see lomo.py)
    **dict.fromkeys(
        (
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
            "apollo_adamw_layerwise",
        ),
        "use the same name without _layerwise",
    ),
    **dict.fromkeys(
        ("stable_adamw", "ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit"),
        "register it with kiln.optim.optimizers.OPTIMIZERS.add(name, factory), or " + _USE_ADAMW,
    ),
}.items():
    OPTIMIZERS.add(_name, _unsupported(_name, _instead))

_package_optimizers.register(OPTIMIZERS)  # schedule-free, GrokAdamW, torchao low-bit, GaLore, APOLLO
_lomo.register(OPTIMIZERS)  # LOMO / AdaLomo: they own backward


# ----------------------------------------------------------------------------- optim_args


def _split_items(text: str) -> list[str]:
    """Split at top-level commas only, so that `betas=(0.9, 0.95)` stays one item."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def _literal(text: str) -> Any:
    """'0.9' -> 0.9, 'true' -> True, 'none' -> None, '(0.9, 0.95)' -> tuple, anything else stays a string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    try:
        return float(text)  # inf, nan
    except ValueError:
        return text


def parse_optim_args(optim_args: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Parse HF's `optim_args` string "key=value,key=value" into Python values.

    HF hands the raw strings to each optimizer; kiln converts them once so that any optimizer class
    can take them as keyword arguments (`momentum=0.9,nesterov=True` for sgd)."""
    if not optim_args:
        return {}
    if isinstance(optim_args, Mapping):
        return dict(optim_args)
    parsed: dict[str, Any] = {}
    for item in _split_items(optim_args.strip()):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier() or not value or key in parsed:
            why = "a repeated key" if key in parsed else "not of the form key=value"
            raise ValueError(
                f"Cannot parse `optim.optim_args` {optim_args!r}: {item.strip()!r} is {why} "
                "(expected 'key=value,key=value', e.g. 'momentum=0.9,nesterov=True')."
            )
        parsed[key] = _literal(value)
    return parsed


# ----------------------------------------------------------------------------- parameter groups


def is_norm_module(module: nn.Module) -> bool:
    """True for normalisation layers, whose weights must not be decayed towards zero.

    HF recognises only `nn.LayerNorm` by type (and a few attribute-name patterns), so the custom RMSNorm
    classes of many models are decayed there by accident. kiln matches the class name instead: every torch
    norm (LayerNorm, GroupNorm, RMSNorm, BatchNorm*, SyncBatchNorm, InstanceNorm*), subclasses of them and
    custom classes such as LlamaRMSNorm all have "Norm" in their own or a base class's name."""
    return any("Norm" in cls.__name__ for cls in type(module).__mro__)


#: HF's `Trainer.get_decay_parameter_names` patterns: a parameter whose FULL dotted name, lower-cased,
#: matches one is not decayed. The full name matters: T5's `relative_attention_bias.weight`, MultiheadAttention's
#: `in_proj_bias` / `bias_k`, BEiT's `q_bias` are biases that a test on the local name ("weight", or equality
#: with "bias") would decay.
NO_DECAY_NAME_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
_NO_DECAY_NAME = re.compile("|".join(f"(?:{p})" for p in NO_DECAY_NAME_PATTERNS))


def _split_parameters(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(decay, no_decay) lists of trainable (name, parameter), in `named_parameters()` order.

    HF's rule: no decay when the full dotted name matches NO_DECAY_NAME_PATTERNS or when the parameter
    lies inside a LayerNorm (at any depth, as HF's recursion tests each enclosing module). kiln also
    treats every norm class (is_norm_module) as HF treats LayerNorm, so the result equals HF's wherever
    HF recognises the norm. Walking the modules ourselves (as named_parameters does) tells us each
    parameter's enclosing modules; a shared parameter is classified by its first name and appears once
    (HF builds its groups from named_parameters(), which also keeps the first name)."""
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    in_norm: dict[str, bool] = {}  # module name -> it or an enclosing module is a norm
    for module_name, module in model.named_modules():
        parent = module_name.rpartition(".")[0] if module_name else None
        norm = in_norm[module_name] = is_norm_module(module) or (parent is not None and in_norm[parent])
        for local, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if not param.requires_grad:
                continue
            name = f"{module_name}.{local}" if module_name else local
            (no_decay if norm or _NO_DECAY_NAME.search(name.lower()) else decay).append((name, param))
    return decay, no_decay


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters that get weight decay (HF's `get_decay_parameter_names`)."""
    return [name for name, _ in _split_parameters(model)[0]]


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's param groups, HF's layout whatever the decay: decayed weights, then biases and
    norm weights without decay.

    Two groups even with weight_decay 0, and even when one is empty, as `transformers.Trainer` builds
    them: HF's Trainer can then resume a kiln checkpoint (and kiln one of HF's) with no regrouping,
    and `get_learning_rates()` gives one rate per group as HF's does. The flat order keys the
    optimizer state_dict and is deterministic, so checkpoints resume across runs; a checkpoint of an
    older kiln that used one group when weight_decay was 0 is re-cut on load (kiln.utils.param_groups)."""
    decay, no_decay = _split_parameters(model)
    if not decay and not no_decay:
        raise ValueError("The model has no trainable parameters (all have requires_grad=False); nothing to optimise.")
    return [
        {"params": [p for _, p in decay], "weight_decay": weight_decay},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]


# ----------------------------------------------------------------------------- build


def optimizer_mode(optimizer: Any, mode: str) -> None:
    """Schedule-free optimizers keep two weight sequences: `train()` before steps, `eval()` before
    evaluation (HF calls these around its loops). Other optimizers have no such methods."""
    switch = getattr(optimizer, mode, None)
    if callable(switch):
        switch()


def _as_optim_config(cfg: Any) -> OptimConfig:
    """Accept the `optim` group as an OptimConfig, a DictConfig or a plain mapping."""
    if isinstance(cfg, OptimConfig):
        return cfg
    get = cfg.get if hasattr(cfg, "get") else (lambda key, default: getattr(cfg, key, default))
    return OptimConfig(**{f.name: get(f.name, f.default) for f in dataclasses.fields(OptimConfig)})


def _check_optim_args(name: str, cls: type, base: dict[str, Any], extra: dict[str, Any]) -> None:
    """Reject optim_args keys that the class does not take, or that the config already sets."""
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    fixed = {"params", "weight_decay", *base}  # weight_decay is set per param group
    accepted = sorted(k for k in params if k not in fixed and k != "self")
    for key in extra:
        if key in fixed:
            source = _FROM_CONFIG.get(key, f"optim.name={name!r}")
            raise ValueError(
                f"`optim.optim_args` sets {key!r}, which optimizer {name!r} takes from {source}; set it there."
            )
        if not takes_any and key not in params:
            raise ValueError(
                f"`optim.optim_args` sets {key!r}, which {cls.__name__} (optimizer {name!r}) does not take; "
                f"it accepts: {', '.join(accepted)}."
            )


def _kernels_for(name: str, cls: type, kwargs: dict[str, Any], groups: Any) -> dict[str, Any]:
    """`kwargs` with the multi-tensor kernels switched off where they cannot run, for the per-parameter
    ones, which make the same update: `fused` on a device torch has no fused kernel for (XLA; torch
    would raise at the first step), and `fused` / `foreach` for a group that mixes DTensors with plain
    tensors or DTensors of different meshes (model_parallel's tp plan leaves unplanned parameters
    plain), which one kernel call cannot span (HF's Trainer splits such groups by mesh instead)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):  # LOMO takes the model itself
        return kwargs
    params = [p for group in groups for p in group["params"]]
    missing = sorted({p.device.type for p in params} - set(_get_fused_kernels_supported_devices()))
    mixed = any(mixes_meshes(group["params"]) for group in groups)
    if mixed and "foreach" in inspect.signature(cls).parameters:
        logger.info(
            "optim.name=%s: a param group mixes DTensors with plain tensors (or meshes), which no multi-tensor "
            "kernel spans; stepping with the per-parameter kernels (the same update).",
            name,
        )
        return {**{k: v for k, v in kwargs.items() if k != "fused"}, "foreach": False}
    if kwargs.get("fused") and missing:
        logger.info(
            "optim.name=%s: torch has no fused kernel for %s parameters; stepping with adamw_torch's kernels "
            "(the same update).",
            name,
            ", ".join(missing),
        )
        return {k: v for k, v in kwargs.items() if k != "fused"}
    return kwargs


def build_optimizer(model: nn.Module, optim_cfg: Any) -> torch.optim.Optimizer:
    """Build the optimizer named by `optim.name` over `model`'s trainable parameters.

    Weight decay goes to weights only, never to biases or normalisation weights; `optim_args` become
    extra keyword arguments. Errors name the config key to fix."""
    cfg = _as_optim_config(optim_cfg)
    factory = OPTIMIZERS.get(cfg.name)
    cls, kwargs = factory(cfg)
    # an entry may carry HF's defaults for settings optim_args can override, and its own param groups
    extra = {**getattr(factory, "defaults", {}), **parse_optim_args(cfg.optim_args)}
    groups = parameter_groups(model, cfg.weight_decay)
    make_groups = getattr(factory, "param_groups", None)
    if make_groups is not None:
        groups = make_groups(model, cfg, extra, groups)
    _check_optim_args(cfg.name, cls, kwargs, extra)
    arguments = _kernels_for(cfg.name, cls, {**kwargs, **extra}, groups)
    try:
        return cls(groups, **arguments)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"Optimizer {cfg.name!r} rejected its arguments ({err}); check optim.lr, optim.adam_* and optim.optim_args."
        ) from err
