"""`strategy: xla_fsdp`: fully sharded data parallel on XLA devices, in one of two classes chosen from
the options (xla_fsdp_options.py) when the strategy is built (`resolve`, as `auto` does):

- `SPMDXLAFSDPStrategy` (fsdp_spmd.py; `wrapper: spmd`, the default; HF `xla_fsdp_v2: true`): SPMD
  FSDPv2, ONE process driving every device of the host through a mesh; the compiler inserts the
  collectives. Checkpoints: DCP, sharded per device ("xla-spmd-sharded").
- `ClassicXLAFSDPStrategy` (fsdp_classic.py; `wrapper: classic`; HF `xla_fsdp_v2: false`): torch_xla's
  `XlaFullyShardedDataParallel`, one process per device. Checkpoints: flat shards per process
  ("xla-fsdp-classic").

What both share is in fsdp_base.py. Neither file imports torch_xla until the strategy is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.strategies import STRATEGIES
from kiln.strategies.xla.fsdp_base import XLAFSDPBase
from kiln.strategies.xla.fsdp_classic import ClassicXLAFSDPStrategy
from kiln.strategies.xla.fsdp_options import resolve
from kiln.strategies.xla.fsdp_spmd import SPMDXLAFSDPStrategy

if TYPE_CHECKING:
    from omegaconf import DictConfig


@STRATEGIES.register("xla_fsdp")
class XLAFSDPStrategy:
    """Not a strategy itself: `resolve` returns the class for the configured wrapper. It carries the
    declarations both classes share, for the docs and the compatibility table."""

    name = XLAFSDPBase.name
    capabilities = XLAFSDPBase.capabilities
    options = XLAFSDPBase.options
    checkpoint_formats = (*SPMDXLAFSDPStrategy.checkpoint_formats, *ClassicXLAFSDPStrategy.checkpoint_formats)

    @staticmethod
    def resolve(config: DictConfig) -> type[XLAFSDPBase]:
        given = dict(config.strategy.get("options") or {}) if config is not None else {}
        return ClassicXLAFSDPStrategy if resolve(given.get).wrapper == "classic" else SPMDXLAFSDPStrategy
