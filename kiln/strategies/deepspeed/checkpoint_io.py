"""DeepSpeed checkpoints inside kiln's `checkpoint-<step>/` folders, full-weight export under ZeRO-3,
and `DeepSpeedCheckpointIO.consolidate` (ZeRO shards -> full weights, without the original process count).

Every rank calls the engine's `save_checkpoint` into the folder (tag `ds`: `ds/mp_rank_00_model_states.pt`
and, under ZeRO, one `*_optim_states.pt` per rank); the engine owns the files, kiln's manager writes
its own state beside them and the COMPLETE marker after every rank returned. Resuming loads the same
files with the same process count (DeepSpeed's ZeRO shards are not reshardable here; `kiln convert`
gives full weights for any count).

DeepSpeed reads its files with `torch.load(weights_only=False)` (its engine and `zero_to_fp32` alike),
which would run a `__reduce__` planted in any of them. So kiln first reads every file under `ds/` itself
with `weights_only=True`, admitting only the few plain-data classes DeepSpeed pickles (`DS_CLASSES`), and
refuses the checkpoint before DeepSpeed opens anything that holds more."""

from __future__ import annotations

import glob
import os
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.strategies.checkpoint_io import CheckpointIO, register_format
from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
from kiln.strategies.model_weights import apply_weights, save_weights
from kiln.strategies.weights_files import share_tied, tie_groups
from kiln.utils.errors import CheckpointError, safe_torch_load

TAG = "ds"
FORMAT = "deepspeed"

#: (module, class) DeepSpeed pickles into its checkpoint files besides tensors and containers; found by
#: saving ZeRO 0-3 checkpoints (DeepSpeed 0.19) and loading them with weights_only=True
DS_CLASSES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def _ds_classes() -> list[type]:
    import importlib

    return [getattr(importlib.import_module(module), name) for module, name in DS_CLASSES]


def load_ds_file(path: str, mmap: bool = False) -> Any:
    """One of DeepSpeed's checkpoint files, read without running code (`weights_only=True` + DS_CLASSES)."""
    return safe_torch_load(
        path, allow=_ds_classes(), what="DeepSpeed's loss scaler, ZeRO stage, fragment records", mmap=mmap
    )


def vet_ds_files(directory: str) -> None:
    """Read every file DeepSpeed may load from `directory/ds/` the safe way first (tensors memory-mapped,
    so the pass is cheap); raises CheckpointError, before DeepSpeed's own `torch.load`, for any file
    holding more than DeepSpeed's plain data."""
    for path in sorted(glob.glob(os.path.join(directory, TAG, "**", "*.pt"), recursive=True)):
        load_ds_file(path, mmap=True)


def is_deepspeed_checkpoint(directory: str) -> bool:
    return os.path.isdir(os.path.join(directory, TAG)) and bool(
        glob.glob(os.path.join(directory, TAG, "*model_states.pt"))
    )


def _prefix(engine_module: nn.Module, module: nn.Module) -> str:
    """How the engine's key names start relative to the user's `module` (kiln's StepDispatcher adds `module.`)."""
    for name, child in engine_module.named_modules():
        if child is module:
            return f"{name}." if name else ""
    return ""


def consolidated_state(directory: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a DeepSpeed checkpoint folder, with the engine's key names: ZeRO 1-3 shards
    merged by DeepSpeed's zero_to_fp32 (any process count), ZeRO-0's module file as it is."""
    root = os.path.join(directory, TAG)
    vet_ds_files(directory)  # zero_to_fp32 reads with weights_only=False
    if glob.glob(os.path.join(root, "*optim_states.pt")) and _zero_stage(root) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(directory, tag=TAG))
    files = sorted(glob.glob(os.path.join(root, "*model_states.pt")))
    if not files:
        raise CheckpointError(f"{directory} holds no DeepSpeed model states ({TAG}/*model_states.pt).")
    state = load_ds_file(files[0])
    return {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items()}


def _zero_stage(root: str) -> int:
    files = sorted(glob.glob(os.path.join(root, "*optim_states.pt")))
    state = load_ds_file(files[0], mmap=True)
    osd = state.get("optimizer_state_dict", {})
    return int(osd.get("zero_stage", 0)) if isinstance(osd, dict) else 0


def _check_group_count(directory: str, engine: Any) -> None:
    """Refuse, before DeepSpeed fails on it with an unrelated message, optimizer state saved in another
    number of param groups: DeepSpeed partitions the state per group, so it cannot be regrouped as
    kiln.utils.param_groups does for a torch optimizer's state."""
    files = sorted(glob.glob(os.path.join(directory, TAG, "*model_states.pt")))
    optimizer = getattr(engine, "basic_optimizer", None) or engine.optimizer
    if not files or optimizer is None:
        return
    state = load_ds_file(files[0], mmap=True)
    shapes, plain = state.get("param_shapes"), state.get("optimizer")
    saved = (
        len(shapes)
        if isinstance(shapes, list)
        else len(plain.get("param_groups", []))
        if isinstance(plain, dict)
        else 0
    )
    current = len(optimizer.param_groups)
    if saved and saved != current:
        raise CheckpointError(
            f"{directory} holds DeepSpeed optimizer state in {saved} parameter groups and this run's optimizer has "
            f"{current} (kiln builds HF's two groups; on 2026-11-25, before HF-parity round 3, it built one when "
            "weight_decay was 0), and DeepSpeed's partitioned state cannot be regrouped: resume with the kiln version "
            "that saved it."
        )


def gathered_state(module: nn.Module, fp32: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict of `module` on every rank: ZeRO-3's partitioned parameters are gathered
    (a no-op for whole ones); with `fp32`, parameters come from the optimizer's fp32 master copy. Tied
    weights stay one tensor (each name is copied out of the gathered parameters), so that a file stores
    them once, as the plain module's `state_dict()` would."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        if fp32:
            for name, param in module.named_parameters(remove_duplicate=False):  # every name of a tie
                full = safe_get_full_fp32_param(param)
                if full is not None:
                    state[name] = (
                        full.detach().cpu().clone().view_as(state[name])
                        if full.numel() == state[name].numel()
                        else state[name]
                    )
    return share_tied(state, tie_groups(module))


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy a full state dict into `module`, whose parameters may be ZeRO-3 partitioned."""
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        own = module.state_dict()
        apply_weights(module, {k: v.to(own[k].dtype) if k in own else v for k, v in state.items()}, source)


@register_format
class DeepSpeedCheckpointIO(CheckpointIO):
    format: ClassVar[str] = FORMAT
    reshardable: ClassVar[bool] = False
    translation_hint: ClassVar[str] = (
        "resume it with strategy deepspeed and the process count that saved it, or write its full weights with "
        "`kiln convert CHECKPOINT OUT` and start a new run from OUT (DeepSpeed's partitioned optimizer state is "
        "not translated to other formats)"
    )
    sharded: ClassVar[bool] = True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @classmethod
    def consolidate(cls, directory: str) -> dict[str, torch.Tensor]:
        """Full fp32 weights merged from every ZeRO shard (any process count), the user's key names."""
        state = consolidated_state(directory)
        if state and all(k.startswith("module.") for k in state):  # kiln's StepDispatcher around a TrainingModule
            state = {k[len("module.") :]: v for k, v in state.items()}
        return state

    def _engine(self, model: nn.Module) -> Any:
        engine = self.strategy.engine
        if engine is None:
            raise CheckpointError(
                "A DeepSpeed checkpoint is saved and resumed through the training engine; train first."
            )
        return engine

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
        engine = self._engine(model)
        if save_optimizer:  # every rank writes its shard; the manager's marker follows all of them
            engine.save_checkpoint(directory, tag=TAG, save_latest=False)
        if not save_optimizer or self.strategy.stage == 3:
            # save_only_model, and ZeRO-3 (whose model file holds no weights): full weights too, so
            # the folder loads with from_pretrained / the plain model (gathering is a collective)
            state = self.strategy.model_state_for_export(module)
            if writer:
                save_weights(state, directory, safetensors)

    def load(
        self,
        directory: str,
        *,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        load_optimizer: bool = True,
    ) -> None:
        if not load_optimizer:
            return self.load_weights_only(directory, model=model, module=module)
        if not is_deepspeed_checkpoint(directory):
            raise CheckpointError(
                f"{directory} is not a DeepSpeed checkpoint ({TAG}/ is missing); it cannot be resumed "
                "with strategy deepspeed."
            )
        engine = self._engine(model)
        vet_ds_files(directory)  # the engine's load_checkpoint reads with weights_only=False
        _check_group_count(directory, engine)
        path, _ = engine.load_checkpoint(directory, tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {directory}.")

    def load_weights_only(self, directory: str, *, model: nn.Module, module: nn.Module) -> None:
        if not is_deepspeed_checkpoint(directory):  # an exported folder or a full checkpoint
            from kiln.strategies.model_weights import load_weights

            return _load_into(module, load_weights(directory), directory)
        state = consolidated_state(directory)
        engine_module: nn.Module = getattr(model, "module", model)
        prefix = _prefix(engine_module, module)
        _load_into(module, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, directory)
        engine = self.strategy.engine
        if engine is not None and self.strategy.stage in (1, 2):  # the fp32 master copy must follow the weights
            engine.optimizer.refresh_fp32_params()


__all__ = ["DeepSpeedCheckpointIO", "FullStateCheckpointIO", "consolidated_state", "gathered_state"]
