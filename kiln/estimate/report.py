"""Per-rank peak memory of each layout, which fit the device, and the table and JSON `kiln estimate` prints.

A step's peak is reached either during backward (the unit a sharded layout has gathered, and the traced
activations with the gradients alive then) or at the optimizer step (all gradients and the optimizer's
temporaries), over what stays resident (weights, optimizer state, DDP's buckets, DeepSpeed's reduce
bucket, which ZeRO-1/2 frees after backward: counted throughout, it can only make the estimate err high);
the larger one is the estimate."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.estimate.layouts import Layout
from kiln.estimate.trace import Activations

GIB = 2**30


@dataclass(frozen=True)
class Row:
    layout: Layout
    activations: float
    peak: float
    fits: bool | None


def peak(layout: Layout, traced: Activations, split: Activations | None = None) -> tuple[float, float]:
    """(activations, peak) in bytes for one rank of `layout`; `split`: the trace of one rank of the model split
    `layout.tp` ways, whose activations (the gathered head's logits and every unsplit layer's included) and
    gradients are that rank's already, so only the dp shard divides its gradients."""
    s = layout.states
    if split is not None:
        activations, grads = float(split.peak), split.grads * layout.grad_share * layout.tp
    else:
        activations, grads = traced.peak * layout.activation_share, traced.grads * layout.grad_share
    backward = s.gathered + activations + grads
    step = s.grads + layout.step_temporaries
    return activations, s.params + s.optimizer + s.buckets + max(backward, step)


def rows(
    layouts: list[Layout],
    traced: Activations,
    device_memory_gib: float | None,
    split: Mapping[int, Activations] | None = None,
) -> list[Row]:
    """One row per layout; `split`: traces of the model split by tp degree (for the layouts with that tp)."""
    out = []
    for layout in layouts:
        found = (split or {}).get(layout.tp) if layout.tp > 1 else None
        activations, total = peak(layout, traced, found)
        fits = None if device_memory_gib is None else total <= device_memory_gib * GIB
        out.append(Row(layout, activations, total, fits))
    return out


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


HEADER = (" strategy", "mesh", "params", "grads", "optimizer", "activations", "peak/rank", "fits")


def table(result: list[Row], header_lines: list[str], configured: str | None = None) -> str:
    """The rows as aligned columns under `header_lines`; the `configured` strategy's rows marked with *."""
    body = []
    for r in result:
        s = r.layout.states
        fits = "-" if r.fits is None else ("yes" if r.fits else "no")
        params = _size(s.params) + (f" +{_size(s.gathered)} gathered" if s.gathered else "")
        grads = _size(s.grads) + (f" +{_size(s.buckets)} buckets" if s.buckets else "")
        mark = "*" if configured and r.layout.strategy.startswith(configured) else " "
        body.append(
            (
                mark + r.layout.strategy,
                r.layout.mesh,
                params,
                grads,
                _size(s.optimizer),
                _size(r.activations),
                _size(r.peak),
                fits,
            )
        )
    widths = [max(len(row[i]) for row in [HEADER, *body]) for i in range(len(HEADER))]
    lines = [*header_lines, "", "  ".join(h.ljust(w) for h, w in zip(HEADER, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
    return "\n".join(lines)


def as_json(result: list[Row], about: dict[str, Any]) -> dict[str, Any]:
    return {
        **about,
        "layouts": [
            {
                "strategy": r.layout.strategy,
                "mesh": r.layout.mesh,
                "params": r.layout.states.params,
                "gathered": r.layout.states.gathered,
                "grads": r.layout.states.grads,
                "optimizer": r.layout.states.optimizer,
                "buckets": r.layout.states.buckets,
                "host": r.layout.states.host,
                "activations": r.activations,
                "peak": r.peak,
                "fits": r.fits,
            }
            for r in result
        ],
    }
