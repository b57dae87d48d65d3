"""HF `optim` names served by optional packages: schedule-free (`schedulefree`), GrokAdamW
(`grokadamw`), torchao's low-bit AdamW (`torchao`), GaLore (`galore-torch`) and APOLLO
(`apollo-torch`). Each is a registry entry that imports its package on first use; a missing package
is one sentence naming the `pip install`. Arguments and `optim_args` defaults follow
`transformers.trainer_optimizer`, so an HF user's settings mean the same here.

`register` adds the names to the registry (kiln.optim.optimizers calls it at its end)."""

from __future__ import annotations

import importlib
import re
from typing import Any

import torch
from torch import nn

from kiln.config.schema.optim import OptimConfig


def _package(module: str, pip_name: str, name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"Optimizer {name!r} (`optim.name`) needs the {pip_name} package: pip install {pip_name}."
        ) from None


def _adam(cfg: OptimConfig) -> dict[str, Any]:
    return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}


class PackageOptimizer:
    """A registry entry for a class in an optional package. `defaults` are HF's values for settings
    that `optim_args` may override (kiln's config-derived arguments may not be overridden)."""

    def __init__(
        self,
        name: str,
        module: str,
        pip_name: str,
        cls_name: str,
        adam: bool = True,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        self.name, self.module, self.pip_name, self.cls_name = name, module, pip_name, cls_name
        self.adam, self.defaults = adam, dict(defaults or {})

    def __call__(self, cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        package = _package(self.module, self.pip_name, self.name)
        return getattr(package, self.cls_name), (_adam(cfg) if self.adam else {"lr": cfg.lr})


def _entries() -> list[PackageOptimizer]:
    # schedule-free: the optimizer does its own warmup (optim_args warmup_steps=N; HF passes its
    # warmup_steps), so pair it with scheduler.name=constant
    sf = {"r": 0.0, "weight_lr_power": 2.0}
    return [
        PackageOptimizer(
            "schedule_free_adamw",
            "schedulefree",
            "schedulefree",
            "AdamWScheduleFree",
            defaults={**sf, "warmup_steps": 0},
        ),
        PackageOptimizer("schedule_free_radam", "schedulefree", "schedulefree", "RAdamScheduleFree", defaults=sf),
        PackageOptimizer(
            "schedule_free_sgd",
            "schedulefree",
            "schedulefree",
            "SGDScheduleFree",
            adam=False,
            defaults={**sf, "warmup_steps": 0},
        ),
        # HF's defaults (equal to the package's); optim_args may change them
        PackageOptimizer(
            "grokadamw",
            "grokadamw",
            "grokadamw",
            "GrokAdamW",
            defaults={
                "alpha_init": 0.98,
                "lamb": 2.0,
                "gamma": 0.1,
                "grokking_signal_decay_rate": 0.1,
                "gradient_clipping": 1.0,
            },
        ),
        PackageOptimizer(
            "adamw_torch_4bit",
            "torchao.optim",
            "torchao",
            "AdamW4bit",
            defaults={"block_size": 256, "bf16_stochastic_round": False},
        ),
        PackageOptimizer(
            "adamw_torch_8bit",
            "torchao.optim",
            "torchao",
            "AdamW8bit",
            defaults={"block_size": 256, "bf16_stochastic_round": False},
        ),
    ]


# ----------------------------------------------------------------------------- GaLore / APOLLO


def _targets(model: nn.Module, targets: Any, name: str) -> list[str]:
    """Names of the nn.Linear weights matched by optim.target_modules (HF: a list of names, a regex, or
    'all-linear')."""
    if targets is None:
        raise ValueError(
            f"Optimizer {name!r} needs optim.target_modules (optim_target_modules): the Linear "
            "modules to project, e.g. ['attn', 'mlp'] or 'all-linear'."
        )
    all_linear = isinstance(targets, str) and targets.replace("_", "-") == "all-linear"
    found = []
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if isinstance(targets, str):
            hit = all_linear or re.fullmatch(targets, module_name) is not None
        else:
            hit = any(module_name == t or module_name.endswith("." + t) or t in module_name for t in targets)
        if hit:
            found.append(module_name + ".weight")
    if not found:
        raise ValueError(
            f"optim.target_modules={targets!r} matches no nn.Linear of the model, so {name!r} would "
            "project nothing; name Linear modules (or use 'all-linear')."
        )
    return found


class LowRank(PackageOptimizer):
    """An entry whose optimizer needs the model: the matched Linear weights get the projection
    settings in their own param group (HF's layout); the rest keep kiln's decay / no-decay groups."""

    def __init__(
        self,
        name: str,
        module: str,
        pip_name: str,
        cls_name: str,
        projection: dict[str, Any],
        projectors: tuple[str, ...],
        fixed: dict[str, Any] | None = None,
        adam_in_targets: bool = False,
    ) -> None:
        super().__init__(name, module, pip_name, cls_name, adam=False)  # HF passes only lr (GaLore's eps is 1e-6)
        self.projection, self.fixed, self.adam_in_targets = projection, dict(fixed or {}), adam_in_targets
        self.projectors = projectors

    def __call__(self, cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        cls, kwargs = super().__call__(cfg)
        # The optimizer state holds projector objects (tensors and numbers only). kiln loads checkpoints
        # with weights_only=True, so these classes, and no others, are allowed for resume to work.
        allowed = []
        for path in self.projectors:
            module, _, attr = path.rpartition(".")
            allowed.append(getattr(importlib.import_module(module), attr))
        torch.serialization.add_safe_globals(allowed)
        return cls, {**kwargs, **self.fixed}

    def param_groups(
        self, model: nn.Module, cfg: OptimConfig, extra: dict[str, Any], groups: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """kiln's decay / no-decay `groups` without the targets, then the targets with the projection
        settings (rank, update_proj_gap, scale, proj_type, ...), which are taken out of optim_args."""
        projection = {key: extra.pop(key, default) for key, default in self.projection.items()}
        targets = {
            id(p) for n, p in model.named_parameters() if n in set(_targets(model, cfg.target_modules, self.name))
        }
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in targets]} for g in groups]
        chosen = [p for p in model.parameters() if id(p) in targets and p.requires_grad]
        adam = _adam(cfg) if self.adam_in_targets else {}  # APOLLO: HF gives the Adam settings to the targets only
        adam.pop("lr", None)
        return [g for g in groups if g["params"]] + [
            {"params": chosen, "weight_decay": cfg.weight_decay, **adam, **projection}
        ]


_GALORE = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
_APOLLO = {
    "rank": 128,
    "proj": "random",
    "scale_type": "channel",
    "update_proj_gap": 200,
    "scale": 1.0,
    "proj_type": "std",
}


_GALORE_STATE = ("galore_torch.galore_projector.GaLoreProjector",)
_APOLLO_STATE = ("apollo_torch.random_projector.GradientProjector", "apollo_torch.svd_projector.GaLoreProjector")


def _low_rank() -> list[LowRank]:
    return [
        LowRank("galore_adamw", "galore_torch", "galore-torch", "GaLoreAdamW", _GALORE, _GALORE_STATE),
        LowRank("galore_adamw_8bit", "galore_torch", "galore-torch", "GaLoreAdamW8bit", _GALORE, _GALORE_STATE),
        LowRank(
            "galore_adafactor",
            "galore_torch",
            "galore-torch",
            "GaLoreAdafactor",
            _GALORE,
            _GALORE_STATE,
            fixed={"scale_parameter": False, "relative_step": False},
        ),
        LowRank(
            "apollo_adamw", "apollo_torch", "apollo-torch", "APOLLOAdamW", _APOLLO, _APOLLO_STATE, adam_in_targets=True
        ),
    ]


def register(registry: Any) -> None:
    """Add every entry of this module to the optimizer registry."""
    for entry in [*_entries(), *_low_rank()]:
        registry.add(entry.name, entry)
