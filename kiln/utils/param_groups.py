"""Saved optimizer and scheduler state in the running optimizer's param-group layout.

kiln builds HF's two groups (decayed weights, then biases and norm weights) whatever the weight
decay, as `transformers.Trainer` does. kiln before HF-parity round 3 put every parameter in one group
when weight decay was 0. Both layouts list the parameters in the same flat order, so a torch
optimizer state_dict, whose per-parameter state is keyed by that flat index, fits either layout once
its `param_groups` are re-cut. That lets a run resume a checkpoint saved in the other layout (one of
that older kiln; the saved settings win, as they always do in `Optimizer.load_state_dict`). Groups
whose settings differ cannot be merged without changing the optimisation, so that case raises
ValueError, which the loaders turn into a CheckpointError."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: scheduler state entries that hold one value per param group (torch's schedulers and kiln's)
PER_GROUP_KEYS = ("base_lrs", "_last_lr", "lr_lambdas", "_init_lrs", "min_lrs", "max_lrs")


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


#: param-group entries that choose the kernel, not the optimisation: this run's config decides them
KERNEL_KEYS = ("fused", "foreach")


def regroup_optimizer_state(saved: Any, param_groups: Sequence[dict[str, Any]]) -> Any:
    """`saved` (an `Optimizer.state_dict()`) with its param groups re-cut to the sizes of
    `param_groups` (the running optimizer's), and their KERNEL_KEYS taken from `param_groups`: a
    checkpoint of `adamw_torch` resumes under `adamw_torch_fused` with the fused kernel (whose step
    counters `load_state_dict` then moves to the parameters' device), and the other way round.
    Not re-cut when the group counts agree or the parameter counts differ (then `load_state_dict`'s
    own check reports the mismatch)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not groups:
        return saved
    return _with_kernels(_recut(saved, groups, param_groups), param_groups)


def _with_kernels(saved: dict[str, Any], param_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    pairs = list(zip(saved["param_groups"], param_groups))
    if all(g.get(k) == run[k] for g, run in pairs for k in KERNEL_KEYS if k in run):
        return saved
    groups = [{**g, **{k: run[k] for k in KERNEL_KEYS if k in run}} for g, run in pairs]
    return {**saved, "param_groups": groups + saved["param_groups"][len(groups) :]}


def _recut(
    saved: dict[str, Any], groups: list[dict[str, Any]], param_groups: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    if len(groups) == len(param_groups):
        return saved
    sizes = [len(g["params"]) for g in param_groups]
    if sum(len(g["params"]) for g in groups) != sum(sizes):
        return saved
    settings = _settings(groups[0])
    differing = sorted({k for g in groups[1:] for k, v in _settings(g).items() if settings.get(k) != v})
    if differing:
        raise ValueError(
            f"its optimizer has {len(groups)} parameter groups with different {', '.join(differing)} and this run's "
            f"has {len(param_groups)}; resume with the weight_decay the checkpoint was saved with"
        )
    flat = [index for g in groups for index in g["params"]]
    regrouped, start = [], 0
    for size in sizes:
        regrouped.append({**settings, "params": flat[start : start + size]})
        start += size
    return {**saved, "param_groups": regrouped}


def regroup_scheduler_state(saved: Any, num_groups: int) -> Any:
    """`saved` (a scheduler's state_dict) with its per-group lists (`PER_GROUP_KEYS`, and those of
    the schedulers a SequentialLR or ChainedScheduler holds) resized to `num_groups`. Lists can be
    resized only when all their values are equal; otherwise ValueError."""
    if not isinstance(saved, dict):
        return saved
    out = dict(saved)
    for key in PER_GROUP_KEYS:
        values = out.get(key)
        if not isinstance(values, list) or len(values) in (0, num_groups):
            continue
        if any(v != values[0] for v in values[1:]):
            raise ValueError(
                f"its {key} holds {len(values)} different per-group values and this run has "
                f"{num_groups} parameter group(s)"
            )
        out[key] = [values[0]] * num_groups
    if isinstance(out.get("_schedulers"), list):
        out["_schedulers"] = [regroup_scheduler_state(s, num_groups) for s in out["_schedulers"]]
    return out
