"""What the two `xla_fsdp` classes share (fsdp_spmd.py and fsdp_classic.py; fsdp.py picks one): the
options, the capabilities, choosing the blocks to wrap, and the bookkeeping of where the user's module
sits inside the wrapped one (for export and checkpoint names)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from kiln.strategies.capabilities import Capabilities
from kiln.strategies.xla.fsdp_options import OPTIONS, XLAFSDPSettings, check_activation_checkpointing, resolve
from kiln.strategies.xla.strategy import XLA_PRECISIONS, XLA_REASONS, XLAStrategy

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)


class XLAFSDPBase(XLAStrategy):
    """The shared part; not registered itself (`xla_fsdp` resolves to a subclass)."""

    name = "xla_fsdp"
    capabilities = Capabilities(
        devices=frozenset({"xla"}),
        precisions=XLA_PRECISIONS,
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        torch_compile=False,
        static_shapes=True,
        reasons=XLA_REASONS,
    )
    options = dict(OPTIONS)

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        if type(self) is XLAFSDPBase:
            raise TypeError(
                "XLAFSDPBase is no strategy by itself: `xla_fsdp` resolves to its SPMD or classic subclass."
            )
        self.settings: XLAFSDPSettings = XLAFSDPSettings()
        self._prefixes: dict[int, str] = {}
        super().__init__(config, precision)

    def _init_topology(self, xr: Any) -> None:
        self.settings = resolve(self.option)
        for key, why in self.settings.no_effect.items():
            log.warning("XLA FSDP setting %r has no effect: %s.", key, why)
        self._init_devices(xr)

    def _init_devices(self, xr: Any) -> None:
        """One process per device (XLAStrategy's topology); SPMD's one process over all devices overrides it."""
        super()._init_topology(xr)

    def setup_module(self, module: nn.Module) -> nn.Module:
        from kiln.strategies.wrap_policy import blocks_to_wrap

        self._prefixes = {id(m): name for name, m in module.named_modules()}
        module = module.to(self.root_device)
        blocks = blocks_to_wrap(module, self.settings.wrap, self.settings.min_num_params)
        check_activation_checkpointing(self.settings, bool(blocks))
        return self.wrap(module, blocks)

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        """Shard `module` (on the device), each of `blocks` one unit."""
        raise NotImplementedError

    def unwrap(self, model: nn.Module) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        return model.module if isinstance(model, (SpmdFullyShardedDataParallel, XlaFullyShardedDataParallel)) else model

    def prefix_of(self, module: nn.Module) -> str:
        """Where the user's `module` sits in the module that was wrapped ("" when it is that module)."""
        return self._prefixes.get(id(module), "")
