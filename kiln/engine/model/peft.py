"""PEFT models (`peft.PeftModel`, e.g. LoRA): checkpoints hold the adapter only, as HF's Trainer
writes them.

HF's `_save` calls `PeftModel.save_pretrained`, which writes `adapter_model.safetensors` and
`adapter_config.json` (the frozen base model is not saved), and its `_load_from_checkpoint` /
`_load_best_model` load the adapter back (`load_adapter`). kiln does the same through one
CheckpointIO, `AdapterCheckpointIO` (format "peft-adapter"), that the engine uses in place of the
strategy's own whenever the run's model is a PeftModel (`checkpoint_io_for`): resume,
`load_best_model_at_end` and `--weights` all read the adapter, and a checkpoint folder is loadable
with `PeftModel.from_pretrained(base_model, checkpoint)`.

The adapter is small and never sharded on disk: a sharded run (FSDP2 DTensors) gathers the
adapter tensors alone (each rank takes part), the writer saves them; loading gives every rank the
full adapter, which each shards again. Its optimizer state goes to `optimizer.pt`, as HF's does:
`Optimizer.state_dict()` when the parameters are plain tensors, the gathered state keyed by parameter
name when they are sharded (torch.distributed.checkpoint's full optimizer state dict).

`peft` is imported only here and only for a model that already is one (`is_peft_model` never imports
it), so `import kiln` stays cheap."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kiln.strategies.checkpoint_io import CheckpointIO, register_format
from kiln.strategies.full_checkpoint_io import OPTIMIZER
from kiln.strategies.model_weights import WEIGHTS_BIN, WEIGHTS_SAFE
from kiln.strategies.weights_files import INDEX
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.param_groups import regroup_optimizer_state

if TYPE_CHECKING:
    from peft import PeftModel

    from kiln.strategies.base import Strategy

ADAPTER_SAFE = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
ADAPTER_CONFIG = "adapter_config.json"
#: the strategies' formats whose model and optimizer state plain torch (or torch.distributed's
#: state-dict API, for FSDP2's DTensors) reads; DeepSpeed and XLA keep their own checkpoint files
_ADAPTER_READY = ("full", "fsdp-full", "fsdp-sharded")


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a `peft.PeftModel` / `PeftMixedModel` (HF's `_is_peft_model`). A model can only
    be one if peft was imported already, so this never imports it."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftMixedModel, PeftModel

    return isinstance(model, (PeftModel, PeftMixedModel))


def base_model_of(model: nn.Module) -> nn.Module:
    """The model inside a PeftModel (HF's `unwrap_peft_model`: its class decides HF's causal-LM
    rules), else `model` itself."""
    return model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]


def holds_adapter(directory: str) -> bool:
    """Whether `directory` holds adapter weights as `PeftModel.save_pretrained` writes them."""
    return any(os.path.exists(os.path.join(directory, name)) for name in (ADAPTER_SAFE, ADAPTER_BIN))


def _holds_model(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name)) for name in (WEIGHTS_SAFE, WEIGHTS_BIN, INDEX))


def checkpoint_io_for(strategy: Strategy, model: nn.Module) -> CheckpointIO:
    """The CheckpointIO for the run's `model` (the user's module): the adapter one for a PeftModel
    under a strategy whose format it can stand in for, else the strategy's own."""
    io = strategy.checkpoint_io()
    if is_peft_model(model) and io.format in _ADAPTER_READY:
        return AdapterCheckpointIO(io)
    return io


def _sharded(module: nn.Module) -> bool:
    """Whether the parameters are DTensors (FSDP2): then state moves through torch.distributed's
    full-state-dict API, a collective every rank calls."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _adapter_folder(directory: str, adapter: str) -> str:
    """Where `save_pretrained` puts an adapter: the folder itself for "default", a subfolder named after
    any other adapter (as HF's `_load_from_checkpoint` expects)."""
    return directory if adapter == "default" else os.path.join(directory, adapter)


def _key_map(module: nn.Module, live: dict[str, torch.Tensor], adapter: str) -> dict[str, str]:
    """Saved adapter key (as in adapter_model.safetensors) -> the module's own state-dict key. peft
    derives the saved names from the state dict by filtering and renaming, keeping the tensors, so the
    two are matched by identity."""
    from peft import get_peft_model_state_dict

    by_id = {id(t): key for key, t in live.items()}
    view = get_peft_model_state_dict(module, state_dict=live, adapter_name=adapter)
    return {saved: by_id[id(t)] for saved, t in view.items() if id(t) in by_id}


def _adapters(module: nn.Module) -> list[str]:
    """The adapter names of a peft model (the functions here are only called with one: is_peft_model)."""
    return list(cast("PeftModel", module).peft_config)


def _gathered_adapter(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of every adapter with the module's own key names, gathered on CPU (every rank
    calls this: one all-gather per sharded tensor, in the same order everywhere)."""
    live = module.state_dict()
    wanted = {key for adapter in _adapters(module) for key in _key_map(module, live, adapter).values()}
    out = {}
    for key, t in live.items():
        if key in wanted:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[key] = full.detach().cpu()
    return out


def _read_adapter(folder: str) -> dict[str, torch.Tensor]:
    safe, binary = os.path.join(folder, ADAPTER_SAFE), os.path.join(folder, ADAPTER_BIN)
    if os.path.exists(safe):
        from safetensors.torch import load_file

        try:
            return load_file(safe)
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{safe} is corrupt or truncated ({err}); use another checkpoint.") from None
    if os.path.exists(binary):
        return safe_torch_load(binary)  # tensors only: nothing in the file can run code
    raise CheckpointError(
        f"No adapter weights ({ADAPTER_SAFE} or {ADAPTER_BIN}) in {folder}; the model is a PeftModel, "
        "so the checkpoint must hold its adapter (saved by kiln or HF's Trainer from a PeftModel)."
    )


def load_adapter(module: nn.Module, directory: str) -> None:
    """Load every adapter of `module` from `directory` (HF's `load_adapter` for each), into plain or
    FSDP2-sharded parameters; a missing or foreign key is one CheckpointError naming it."""
    live = module.state_dict()
    full: dict[str, Any] = {}  # set_model_state_dict's value type is wider than load_state_dict's
    for adapter in _adapters(module):
        folder = _adapter_folder(directory, adapter)
        saved, names = _read_adapter(folder), _key_map(module, live, adapter)
        unexpected, missing = sorted(set(saved) - set(names)), sorted(set(names) - set(saved))
        if unexpected or missing:
            what = "; ".join(
                f"{label}: {', '.join(keys[:6])}" + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
                for label, keys in (("missing keys", missing), ("unexpected keys", unexpected))
                if keys
            )
            raise CheckpointError(
                f"The adapter in {folder} does not fit adapter {adapter!r} of this model ({what}); "
                "load it into a PeftModel built with the same peft config and base model."
            )
        for key, t in saved.items():
            own = live[names[key]]
            if tuple(own.shape) != tuple(t.shape):
                raise CheckpointError(
                    f"The adapter in {folder} does not fit this model: {key} is {tuple(t.shape)} there "
                    f"and {tuple(own.shape)} here; use the peft config (rank r) it was trained with."
                )
            full[names[key]] = t
    if _sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        with torch.no_grad():
            for key, t in full.items():
                live[key].copy_(t)


@register_format
class AdapterCheckpointIO(CheckpointIO):
    """Adapter files (`PeftModel.save_pretrained`) plus `optimizer.pt`; never sharded on disk, so a
    checkpoint loads on any number of processes. Folders without adapter files (a full save) are
    left to the strategy's own CheckpointIO for `load_weights_only`."""

    format = "peft-adapter"
    reshardable = True
    sharded = False

    def __init__(self, inner: CheckpointIO | None = None) -> None:
        self.inner = inner

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        """The default adapter's tensors, under the names `save_pretrained` gave them."""
        return _read_adapter(directory)

    def save(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        save_optimizer: bool,
        safetensors: bool,
        writer: bool,
    ) -> None:
        sharded = _sharded(module)
        state = _gathered_adapter(module) if sharded else None  # collective when sharded
        optim = None
        if save_optimizer and optimizer is not None:
            if sharded:  # collective: every rank takes part; keyed by parameter name
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

                optim = get_optimizer_state_dict(
                    module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
                )
            else:
                optim = optimizer.state_dict()
        if not writer:
            return
        # HF's `_save` for a PeftModel: adapter weights and adapter_config.json, no base model
        module.save_pretrained(directory, state_dict=state, safe_serialization=safetensors)  # type: ignore[operator]
        if optim is not None and (not sharded or _rank() == 0):  # gathered with cpu_offload: rank 0 holds it
            torch.save(optim, os.path.join(directory, OPTIMIZER))

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        load_adapter(module, directory)
        if load_optimizer and optimizer is not None:
            _load_optimizer(directory, module, optimizer)

    def load_weights_only(self, directory: str, *, model: nn.Module, module: nn.Module) -> None:
        if self.inner is not None and not holds_adapter(directory) and _holds_model(directory):
            # a full model folder (the whole PeftModel's weights, e.g. saved by an older kiln): the strategy reads it
            self.inner.load_weights_only(directory, model=model, module=module)
        else:
            load_adapter(module, directory)


def _load_optimizer(directory: str, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    path = os.path.join(directory, OPTIMIZER)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: this checkpoint cannot be resumed (saved with save_only_model?).")
    saved = safe_torch_load(path)
    sharded = _sharded(module)
    by_name = any(isinstance(k, str) for k in (saved.get("state") or {}))
    if by_name != sharded:
        raise CheckpointError(
            f"{path} was saved by a run whose parameters were {'' if by_name else 'not '}sharded "
            f"(FSDP) and this run's are {'' if sharded else 'not'}; resume with a strategy like the one "
            "that saved it."
        )
    try:
        regrouped = regroup_optimizer_state(saved, optimizer.param_groups)
        if sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(module, optimizer, regrouped, options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(regrouped)
    except (ValueError, KeyError) as err:
        raise CheckpointError(
            f"The optimizer state in {path} does not fit this optimizer ({err}); was optim.name or "
            "the peft config (which parameters train) changed?"
        ) from None
