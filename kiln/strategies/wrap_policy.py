"""Which submodules become FSDP units (auto-wrap): by class name, by the model's `_no_split_modules`, or by
size, keeping tied weights in one unit. Shared by the mesh strategy (`fsdp`, `model_parallel`) and
`xla_fsdp`; also the blocks activation checkpointing and per-block compilation act on."""

from __future__ import annotations

import logging

from torch import nn

from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)


def _owners(module: nn.Module) -> dict[int, set[str]]:
    """Parameter id -> names of every module that registers it (shared parameters have several)."""
    owners: dict[int, set[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for p in sub._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(name)
    return owners


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def blocks_to_wrap(module: nn.Module, names: list[str] | None, min_num_params: int | None) -> list[nn.Module]:
    """The submodules to fully_shard before the root, innermost first. By class name (`names`, or
    the model's `_no_split_modules` when neither is given), or by size (`min_num_params`). A block
    that shares a parameter with a module outside it (tied weights) is left to its parent unit, so
    the tie survives."""
    named = [(n, m) for n, m in module.named_modules() if n]
    if min_num_params:
        candidates = _by_size(module, min_num_params)
    else:
        wanted = names if names is not None else list(getattr(module, "_no_split_modules", None) or [])
        if not wanted:
            return []
        present = {type(m).__name__ for _, m in named}
        missing = [w for w in wanted if w not in present]
        if names is not None and missing:
            found = sorted(
                type(m).__name__
                for _, m in named
                if any(True for _ in m.parameters(recurse=False)) or len(list(m.children())) > 0
            )
            raise ConfigError(
                f"FSDP wrap class {', '.join(missing)} is not in the model; its module classes are: "
                f"{', '.join(sorted(set(found)))}."
            )
        candidates = [(n, m) for n, m in named if type(m).__name__ in wanted]
    owners = _owners(module)
    everything = {id(p) for p in module.parameters()}
    chosen = []
    for name, block in candidates:
        if {id(p) for p in block.parameters()} == everything:
            # the user's module inside kiln's step dispatcher: its steps are called without its own
            # forward, so its unit would never be gathered; the root unit covers it
            continue
        shared = [p for p in block.parameters() if any(not _inside(o, name) for o in owners.get(id(p), ()))]
        if shared:
            log.info(
                "FSDP: %s (%s) shares parameters with modules outside it; it stays in its parent's unit.",
                name,
                type(block).__name__,
            )
            continue
        chosen.append((name, block))
    chosen.sort(key=lambda nb: -nb[0].count("."))  # innermost first
    return [b for _, b in chosen]


def _by_size(module: nn.Module, min_num_params: int) -> list[tuple[str, nn.Module]]:
    """HF's size-based policy: post-order, a submodule whose parameters not yet in a unit number at
    least `min_num_params` becomes one."""
    taken: set[int] = set()
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, m: nn.Module) -> None:
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if not name:
            return
        free = [p for p in m.parameters() if id(p) not in taken]
        if sum(p.numel() for p in free) >= min_num_params:
            taken.update(id(p) for p in free)
            out.append((name, m))

    visit("", module)
    return out
