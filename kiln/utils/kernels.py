"""Which multi-tensor optimizer kernels a param group can run.

One `foreach` or `fused` kernel call takes every tensor of a group at once, and DTensor refuses a call
that mixes DTensors with plain tensors (or DTensors of different meshes): model_parallel's tp plan
leaves the parameters it does not split plain, so a group can hold both. torch picks `foreach` by
itself on CUDA (its default, `foreach=None`), so an optimizer a user builds in `configure_optimizers`
would fail at its first step there; the per-parameter kernel makes the same update."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kiln.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def mixes_meshes(params: Iterable[Any]) -> bool:
    """Whether `params` hold DTensors of more than one mesh, or DTensors and plain tensors together. Meshes
    are told apart by value, as DTensor's own ops tell them apart: equal DeviceMesh objects are one mesh to a
    multi-tensor kernel. (A second mesh run in one process gets some of its meshes from torch's caches and
    some new, equal ones; told apart by identity they switched the fused kernel off, a last-bit change.)"""
    return len({getattr(p, "device_mesh", None) for p in params}) > 1


def per_parameter_kernels_where_mixed(optimizer: Any) -> None:
    """Set `foreach=False` on each param group of `optimizer` that mixes meshes and leaves the kernel to
    torch's default; a group that asks for `foreach` or `fused` explicitly is refused in one sentence,
    since that request cannot run."""
    for index, group in enumerate(getattr(optimizer, "param_groups", ())):
        if not isinstance(group, dict) or not mixes_meshes(group.get("params", ())):
            continue
        asked = [k for k in ("fused", "foreach") if group.get(k)]
        if asked:
            raise ConfigError(
                f"Param group {index} of the {type(optimizer).__name__} optimizer mixes DTensors with plain tensors "
                f"(or DTensors of different meshes), which its {asked[0]}=True kernel cannot step in one call; "
                f"build it with {asked[0]}=False (the same update, one parameter at a time)."
            )
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = False
            logger.info(
                "Param group %d of the %s optimizer mixes DTensors with plain tensors (or meshes), which no "
                "multi-tensor kernel spans; it steps with the per-parameter kernel (the same update).",
                index,
                type(optimizer).__name__,
            )
