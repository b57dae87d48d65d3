"""The DeepSpeed config a run uses: the user's (a JSON path or a mapping, HF's `deepspeed` argument,
or the stage a registry name implies), with every `"auto"` filled from kiln's config exactly as
Hugging Face's `HfTrainerDeepSpeedConfig.trainer_config_process` / `trainer_config_finalize` do.

kiln's config stays the single source of truth for the values both sides have (batch size,
accumulation, clipping, optimizer hyperparameters, precision):

- `"auto"` or absent in the DeepSpeed config: kiln's value is written into it (absent matters:
  DeepSpeed's own default `gradient_clipping` is 1.0, not kiln's);
- set in the DeepSpeed config while kiln's value is its default: the DeepSpeed value is adopted
  into kiln's config as it loads (`adopt`; this is how accelerate's plugin settings such as
  `gradient_clipping: 0.7` arrive);
- set on both sides with different values: one ConfigError naming every pair.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from typing import Any

from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)

#: registry name -> the zero_optimization section it implies (a config's own section wins)
NAMED_STAGES: dict[str, dict[str, Any]] = {
    "deepspeed": {"stage": 2},
    "deepspeed_stage_1": {"stage": 1},
    "deepspeed_stage_2": {"stage": 2},
    "deepspeed_stage_3": {"stage": 3},
    "deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "deepspeed_stage_3_offload": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    },
}

#: (DeepSpeed key, kiln key) pairs that must agree; the kiln side is the source of truth
_MATCHED = (
    ("train_micro_batch_size_per_gpu", "data.per_device_train_batch_size"),
    ("gradient_accumulation_steps", "train.gradient_accumulation_steps"),
    ("gradient_clipping", "train.max_grad_norm"),
)
_OPTIMIZER = (
    ("optimizer.params.lr", "optim.lr"),
    ("optimizer.params.eps", "optim.adam_epsilon"),
    ("optimizer.params.weight_decay", "optim.weight_decay"),
)
_DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp16-true": "fp16", "bf16-true": "bf16"}


def read_user_config(value: Any) -> dict[str, Any]:
    """The DeepSpeed config the user gave: a JSON file path, a JSON string, or a mapping."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value
        if not value.lstrip().startswith("{"):
            if not os.path.exists(value):
                raise ConfigError(
                    f"DeepSpeed config file {value!r} does not exist; pass a JSON file path or a mapping."
                )
            with open(value, encoding="utf-8") as fh:
                text = fh.read()
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"DeepSpeed config {value!r} is not valid JSON ({err}); fix the file.") from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"DeepSpeed config {value!r} must hold a JSON object, not {type(parsed).__name__}.")
        return parsed
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            return OmegaConf.to_container(value, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a kiln dependency
        pass
    if isinstance(value, dict):
        return copy.deepcopy(value)
    raise ConfigError(f"strategy.config must be a DeepSpeed JSON path or a mapping, not {type(value).__name__}.")


def _node(config: dict[str, Any], dotted: str, create: bool = False) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = dotted.split(".")
    node: Any = config
    for part in parents:
        if not isinstance(node.get(part), dict):
            if not create:
                return None, leaf
            node[part] = {}
        node = node[part]
    return node, leaf


def _get(config: dict[str, Any], dotted: str) -> Any:
    node, leaf = _node(config, dotted)
    return None if node is None else node.get(leaf)


def _kiln(cfg: Any, dotted: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, dotted)


def _kiln_default(dotted: str) -> Any:
    from kiln.config.schema import TrainingConfig

    node: Any = TrainingConfig()
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


class Mismatches(list):
    def add(self, ds_key: str, ds_value: Any, kiln_key: str, kiln_value: Any) -> None:
        self.append(f"DeepSpeed {ds_key}={ds_value!r} vs kiln {kiln_key}={kiln_value!r}")

    def raise_if_any(self) -> None:
        if self:
            raise ConfigError(
                "The DeepSpeed config and kiln's config disagree ("
                + "; ".join(self)
                + '); set the DeepSpeed values to "auto" or make both sides equal.'
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _match(
    ds: dict[str, Any],
    cfg: Any,
    ds_key: str,
    kiln_key: str,
    bad: Mismatches,
    kiln_value: Any = None,
    fill_absent: bool = True,
) -> None:
    """One key: fill "auto" (and absent when `fill_absent`), else record a mismatch."""
    value = _kiln(cfg, kiln_key) if kiln_value is None else kiln_value
    node, leaf = _node(ds, ds_key, create=fill_absent)
    if node is None:
        return
    current = node.get(leaf)
    if current == "auto" or (current is None and fill_absent):
        node[leaf] = value
    elif current is not None and not _same(current, value):
        bad.add(ds_key, current, kiln_key, value)


def adopt(cfg: Any) -> None:
    """As the config loads (in place, before it is read-only): each number the DeepSpeed config of a
    DeepSpeed run sets where kiln's value is at its default becomes kiln's value, so that there is one
    copy (this is how accelerate's plugin settings such as `gradient_clipping: 0.7` arrive). The keys
    `process` matches in the same order; it then finds them equal."""
    if cfg.strategy.name not in NAMED_STAGES:
        return
    try:
        user = read_user_config((cfg.strategy.get("options") or {}).get("config"))
    except ConfigError:  # refused in these words when the strategy is built (a config may load on another machine)
        return
    pairs = [
        *_MATCHED,
        *(_OPTIMIZER if "optimizer" in user else ()),
        *((("scheduler.params.warmup_max_lr", "optim.lr"),) if "scheduler" in user else ()),
    ]
    for ds_key, kiln_key in pairs:
        current, value = _get(user, ds_key), _kiln(cfg, kiln_key)
        if current not in (None, "auto") and not _same(current, value) and _same(value, _kiln_default(kiln_key)):
            from omegaconf import OmegaConf

            log.info(
                "DeepSpeed config sets %s=%r; kiln's %s (at its default) takes that value.", ds_key, current, kiln_key
            )
            OmegaConf.update(cfg, kiln_key, current, merge=False)


def process(cfg: Any, user: dict[str, Any], *, world_size: int, precision: str, name: str) -> dict[str, Any]:
    """HF's `trainer_config_process`: everything that does not need the model or the step count (the
    config is only read: `adopt` took the DeepSpeed values into it as it loaded)."""
    ds = copy.deepcopy(user)
    zero = ds.setdefault("zero_optimization", {})
    for key, value in NAMED_STAGES.get(name, {}).items():
        zero.setdefault(key, copy.deepcopy(value))
    zero.setdefault("stage", 0)
    bad = Mismatches()
    for ds_key, kiln_key in _MATCHED:
        _match(ds, cfg, ds_key, kiln_key, bad)
    per_device, accumulation = (
        _kiln(cfg, "data.per_device_train_batch_size"),
        _kiln(cfg, "train.gradient_accumulation_steps"),
    )
    _match(
        ds,
        cfg,
        "train_batch_size",
        "train_batch_size (per_device_train_batch_size x gradient_accumulation_steps x world size)",
        bad,
        kiln_value=world_size * per_device * accumulation,
    )
    if "optimizer" in ds:
        for ds_key, kiln_key in _OPTIMIZER:
            _match(ds, cfg, ds_key, kiln_key, bad, fill_absent=False)
        betas = [_kiln(cfg, "optim.adam_beta1"), _kiln(cfg, "optim.adam_beta2")]
        _match(
            ds, cfg, "optimizer.params.betas", "optim.adam_beta1+adam_beta2", bad, kiln_value=betas, fill_absent=False
        )
    if "scheduler" in ds:
        node, leaf = _node(ds, "scheduler.params.warmup_min_lr")
        if node is not None and node.get(leaf) == "auto":  # HF's fill_only: not a trainer argument
            node[leaf] = 0
        _match(ds, cfg, "scheduler.params.warmup_max_lr", "optim.lr", bad, fill_absent=False)
    _precision(ds, precision, bad)
    bad.raise_if_any()
    ds.setdefault("steps_per_print", 10**9)  # kiln logs; DeepSpeed's progress prints would duplicate it
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def _precision(ds: dict[str, Any], precision: str, bad: Mismatches) -> None:
    """fp16.enabled / bf16.enabled from kiln's precision plugin (HF: from fp16 / bf16)."""
    wanted = _DTYPES.get(precision)
    for kind in ("fp16", "bf16"):
        section = ds.get(kind)
        enabled = section.get("enabled") if isinstance(section, dict) else None
        if enabled == "auto" or (enabled is None and wanted == kind):
            ds.setdefault(kind, {})["enabled"] = wanted == kind
        elif enabled is True and wanted not in (None, kind):
            bad.add(f"{kind}.enabled", True, "precision.name", precision)


def dtype_of(ds: dict[str, Any]) -> str | None:
    """ "fp16", "bf16" or None (fp32), as the finished DeepSpeed config says."""
    for kind in ("bf16", "fp16"):
        section = ds.get(kind)
        if isinstance(section, dict) and section.get("enabled") is True:
            return kind
    return None


def hidden_size(model: Any) -> int | None:
    """The model's hidden size as HF reads it for the bucket-size "auto" values."""
    config = getattr(model, "config", None)
    for node in (config, getattr(config, "text_config", None)):
        if node is None:
            continue
        if getattr(node, "hidden_size", None) is not None:
            return int(node.hidden_size)
        if getattr(node, "hidden_sizes", None):
            return int(max(node.hidden_sizes))
    return None


def finalize(ds: dict[str, Any], model: Any, *, cfg: Any, max_steps: int | None) -> dict[str, Any]:
    """HF's `trainer_config_finalize`: the hidden-size based bucket sizes and the scheduler's steps
    (`max_steps`: the run's optimizer step count as the loop computed it, HF's num_training_steps)."""
    fill_bucket_sizes(ds.get("zero_optimization", {}), model)
    _scheduler_steps(ds, cfg, max_steps)
    return ds


def fill_bucket_sizes(zero: dict[str, Any], model: Any) -> None:
    """HF's hidden-size based values for the zero_optimization bucket sizes given as "auto" (in place)."""
    keys = ["reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
    auto = [k for k in keys if zero.get(k) == "auto"]
    if auto:
        size = hidden_size(model)
        if size is None:
            raise ConfigError(
                f'The model\'s config has no hidden_size, so the DeepSpeed "auto" values '
                f"{', '.join('zero_optimization.' + k for k in auto)} cannot be filled; give them numbers."
            )
        if zero.get("reduce_bucket_size") == "auto":
            zero["reduce_bucket_size"] = size * size
        if zero.get("stage") == 3:
            if zero.get("stage3_prefetch_bucket_size") == "auto":
                zero["stage3_prefetch_bucket_size"] = int(0.9 * size * size)
            if zero.get("stage3_param_persistence_threshold") == "auto":
                zero["stage3_param_persistence_threshold"] = 10 * size


def _scheduler_steps(ds: dict[str, Any], cfg: Any, max_steps: int | None) -> None:
    """HF's rule for WarmupLR / WarmupDecayLR / WarmupCosineLR: `total_num_steps` is the run's step
    count and `warmup_num_steps` is `get_warmup_steps(count)` kept at least 1; "auto" is filled, a
    number that differs is a mismatch (a warmup number is kept while kiln's warmup is at its default)."""
    params = ds.get("scheduler", {}).get("params") if isinstance(ds.get("scheduler"), dict) else None
    if not isinstance(params, dict) or not {"total_num_steps", "warmup_num_steps"} & set(params):
        return
    if max_steps is None or max_steps <= 0:
        if "auto" in (params.get("total_num_steps"), params.get("warmup_num_steps")):
            raise ConfigError(
                "The DeepSpeed scheduler's \"auto\" total_num_steps/warmup_num_steps need the run's step "
                "count, which is not known yet (auto_find_batch_size?); give them as numbers."
            )
        return
    warmup = int(cfg.scheduler.warmup_steps or 0)
    warmup = warmup if warmup > 0 else math.ceil(float(cfg.scheduler.warmup_ratio or 0.0) * max_steps)
    warmup_is_default = not cfg.scheduler.warmup_steps and not cfg.scheduler.warmup_ratio
    bad = Mismatches()
    for key, value, kiln_key in (
        ("total_num_steps", max_steps, "the run's optimizer steps (max_steps or epochs x steps per epoch)"),
        ("warmup_num_steps", max(1, warmup), "scheduler.warmup_steps/warmup_ratio"),
    ):
        current = params.get(key)
        if current == "auto":
            params[key] = value
        elif (
            current is not None and not _same(current, value) and not (key == "warmup_num_steps" and warmup_is_default)
        ):
            bad.add(f"scheduler.params.{key}", current, kiln_key, value)
    bad.raise_if_any()
