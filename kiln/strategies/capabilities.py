"""What each strategy can do, declared as data, and the compatibility check built on it.

Every strategy class carries a `Capabilities`. Before any process group starts, the Trainer asks
`check_compatible` whether the chosen strategy, precision plugin, device and run options can work
together; an impossible combination is refused with one sentence that says why and what to use,
instead of failing halfway through the first step. The same table is what docs/strategies.md shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.utils.errors import CapabilityError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Capabilities:
    #: device types the strategy runs on ("cpu", "cuda", "mps", "xla")
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    #: precision plugin names it accepts (None: every plugin)
    precisions: frozenset[str] | None = None
    #: `auto_find_batch_size` can probe on `probe_module` (an OOM on one rank must not hang the others)
    auto_batch_size: bool = True
    #: `precision.full_eval` can cast the module's parameters in place for evaluation
    full_eval_cast: bool = True
    #: an optimizer built by the user before the Trainer (`optimizers=(opt, sched)`) can be used
    user_optimizer: bool = True
    #: the module `setup` returns may be torch.compile'd by the engine (`train.torch_compile*`); the
    #: reason for False is `reasons["torch_compile"]`
    torch_compile: bool = True
    #: every training step must see the same shapes (the XLA family compiles one graph per input shape):
    #: the Trainer drops each epoch's short last training batch (as `dataloader_drop_last`, saying how many
    #: samples in one log line) and pads a short accumulation window's item counts with zero counts on the
    #: device, so the epoch's last window replays the graphs of a full one
    static_shapes: bool = False
    #: `setup` hands back the strategy's own engine wrapping module and optimizer together, and its
    #: `optimizer_step` runs that engine's step, which clips, scales and may skip (DeepSpeed): the engine
    #: then neither merges HF's two param groups into one step nor compiles the optimizer step
    owns_optimizer_step: bool = False
    #: with `train.torch_compile*` the strategy compiles each block's forward before it wraps the block
    #: (FSDP2: compiled blocks, then `fully_shard`, torchtitan's order), so its per-block hooks run
    #: outside the compiled graphs; compiling the whole wrapped module on top would trace into those
    #: hooks, so the engine leaves the set-up module uncompiled
    compiles_per_block: bool = False
    #: why a device, precision or feature ("torch_compile") is refused, keyed by name, for messages
    #: that say more than "no"
    reasons: dict[str, str] = field(default_factory=dict)


def check_compatible(
    strategy_name: str,
    caps: Capabilities,
    *,
    precision: str,
    device: torch.device,
    full_eval: bool = False,
    auto_batch_size: bool = False,
    user_optimizer: bool = False,
    torch_compile: bool = False,
) -> None:
    """Raise CapabilityError for the first impossible pairing, naming both sides and the fix."""
    if device.type not in caps.devices:
        why = caps.reasons.get(device.type, f"it runs on {', '.join(sorted(caps.devices))}")
        raise CapabilityError(
            f"strategy {strategy_name!r} cannot run on {device.type!r}: {why}. "
            f"Use strategy: {_one_device_strategy(device.type)} on this device."
        )
    if caps.precisions is not None and precision not in caps.precisions:
        why = caps.reasons.get(precision, f"it supports {', '.join(sorted(caps.precisions))}")
        raise CapabilityError(f"strategy {strategy_name!r} cannot train with precision {precision!r}: {why}.")
    if full_eval and not caps.full_eval_cast:
        raise CapabilityError(
            f"precision.full_eval (fp16_full_eval / bf16_full_eval) casts the whole model in place, "
            f"which strategy {strategy_name!r} cannot do with its sharded parameters; remove full_eval."
        )
    if auto_batch_size and not caps.auto_batch_size:
        raise CapabilityError(
            f"auto_find_batch_size is not supported with strategy {strategy_name!r} (an out-of-memory "
            "probe on one rank would leave the others waiting); set per_device_train_batch_size yourself."
        )
    if user_optimizer and not caps.user_optimizer:
        raise CapabilityError(
            f"strategy {strategy_name!r} must build the optimizer over the parameters it sets up, so an "
            "optimizer passed as optimizers=(...) cannot be used; configure optim.* instead "
            "(or override Trainer.create_optimizer)."
        )
    if torch_compile and not caps.torch_compile:
        why = caps.reasons.get("torch_compile", "it cannot run a compiled module")
        raise CapabilityError(
            f"torch_compile cannot be used with strategy {strategy_name!r}: {why}; drop torch_compile."
        )


def _one_device_strategy(device_type: str) -> str:
    return {"mps": "mps", "xla": "xla"}.get(device_type, "single")
