"""Resume from a checkpoint written by Hugging Face's Trainer (a user switching to kiln mid-training).

An HF checkpoint has HF's file names (`model.safetensors` or shards, `optimizer.pt`, `scheduler.pt`,
`rng_state.pth` / `rng_state_<rank>.pth`, `trainer_state.json`), no COMPLETE marker and no kiln files
(`config.yaml`, `loop_state_*.pt`); `training_args.bin` (a pickle) is never read. What can be restored
is restored, and one log line says what could not be, so nobody mistakes the result for an exact
resume: kiln's sampler orders the data differently from HF's, so the epoch position is kept
(HF's rule: `global_step` steps into the run) but not the samples; the running loss sums of the
interrupted logging window are not in the checkpoint."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Optional

from kiln.engine.callbacks.state import TrainerState
from kiln.engine.checkpoint.files import is_hf_checkpoint  # noqa: F401  (re-exported: the manager asks here)
from kiln.engine.data.loaders import loader_length
from kiln.engine.seed import _py_state_to_plain
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.param_groups import regroup_optimizer_state, regroup_scheduler_state

log = logging.getLogger(__name__)


def _hf_rng(path: str) -> Optional[dict[str, Any]]:
    """HF's RNG file (numpy's state is an ndarray) in kiln's layout; numpy's array types are the only
    extra globals allowed, so nothing in the file can run code."""
    import numpy as np
    import torch

    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    reconstruct = getattr(getattr(np, "_core", np.core), "multiarray")._reconstruct
    try:
        with torch.serialization.safe_globals([*allowed, reconstruct]):
            raw = torch.load(path, map_location="cpu", weights_only=True)
        kind, keys, pos, has_gauss, cached = raw["numpy"]
        state: dict[str, Any] = {"python": _py_state_to_plain(raw["python"]), "torch": raw["cpu"],
                                 "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys).astype("int64")),
                                           "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}}
    except Exception as err:  # an unexpected layout or a file that needs other globals
        log.warning("Could not read HF's RNG state %s (%s); random streams are not restored.", path, err)
        return None
    if "cuda" in raw:
        state["cuda"] = raw["cuda"] if isinstance(raw["cuda"], list) else [raw["cuda"]]
    return state


def load_hf_checkpoint(manager: Any, path: str) -> None:
    """Restore what an HF checkpoint holds into the (already set-up) trainer, and say what was not."""
    t = manager.trainer
    restored, missing = ["weights"], []
    io = t.strategy.checkpoint_io()
    io.load_weights_only(path, model=t.model_wrapped, module=t.model)
    if t.optimizer is not None and os.path.exists(os.path.join(path, "optimizer.pt")):
        try:
            saved = safe_torch_load(os.path.join(path, "optimizer.pt"))  # HF: two groups, even without decay
            t.optimizer.load_state_dict(regroup_optimizer_state(saved, t.optimizer.param_groups))
            restored.append("optimizer")
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{path}/optimizer.pt does not fit this run's optimizer ({err}); use the optim and "
                                  "weight_decay the HF run used.") from None
    else:
        missing.append("optimizer state")
    sched = os.path.join(path, "scheduler.pt")
    if t.lr_scheduler is not None and os.path.exists(sched):
        try:
            saved = safe_torch_load(sched)
            if t.optimizer is not None:
                saved = regroup_scheduler_state(saved, len(t.optimizer.param_groups))
            t.lr_scheduler.load_state_dict(saved)
            restored.append("scheduler")
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{sched} does not fit this run's scheduler {type(t.lr_scheduler).__name__} ({err}); "
                                  "use the lr_scheduler_type the HF run used.") from None
    elif t.lr_scheduler is not None:
        missing.append("scheduler state")
    try:
        t.state = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}/trainer_state.json is unreadable ({err}).") from None
    restored.append("trainer state (step, log history, best metric)")
    _compare_cadence(t, path)
    callbacks = {k: v for k, v in (t.state.stateful_callbacks or {}).items() if k != "TrainerControl"}
    gone = t.callback_handler.load_state_dict(callbacks, restore_args=bool(t.config.save.restore_callback_states_from_checkpoint))
    if gone:
        warnings.warn(f"{path} holds state for callbacks this run does not have ({', '.join(gone)}); it is ignored.", stacklevel=3)
    if callbacks:
        restored.append("callback state")
    rank = t.strategy.global_rank
    rng_file = next((os.path.join(path, n) for n in (f"rng_state_{rank}.pth", "rng_state.pth")
                     if os.path.exists(os.path.join(path, n))), None)
    manager.pending_rng = _hf_rng(rng_file) if rng_file else None
    (restored if manager.pending_rng is not None else missing).append("RNG state")
    manager.pending_loop = None
    _set_position(manager)
    missing += ["the sampler position (kiln's sampler orders samples differently from HF's; the epoch position is kept)",
                "the running loss sums of the interrupted logging window"]
    if os.path.exists(os.path.join(path, "scaler.pt")):
        missing.append("the fp16 grad scaler (scaler.pt)")
    warnings.warn(f"Resumed from Hugging Face checkpoint {path} at step {t.state.global_step}: restored "
                  f"{', '.join(restored)}; not restored: {'; '.join(missing)}. The run continues from here but will "
                  "not match the HF run it came from exactly.", stacklevel=3)


def _compare_cadence(t: Any, path: str) -> None:
    """HF's `compare_trainer_and_checkpoint_args`: warn, naming them, when the logging, eval or save
    interval differs from the one the checkpoint was trained with."""
    st, cfg = t.state, t.config
    pairs = (("logging_steps", st.logging_steps, cfg.log.steps), ("eval_steps", st.eval_steps, cfg.eval.steps),
             ("save_steps", st.save_steps, cfg.save.steps))
    changed = [f"{name} {old!r} -> {new!r}" for name, old, new in pairs
               if new is not None and float(new) >= 1 and old is not None and int(old) != int(new)]
    if changed:
        warnings.warn(f"Resuming {path} with settings that differ from the checkpoint's ({'; '.join(changed)}): "
                      "the run continues with this run's values.", stacklevel=4)


def _set_position(manager: Any) -> None:
    """HF's rule: `global_step` full epochs of `ceil(batches / k)` steps, then the remainder in windows of k."""
    import math

    t = manager.trainer
    st = t.state
    k = int(t.config.train.gradient_accumulation_steps)
    batches = loader_length(manager.loader) if manager.loader is not None else None
    if not batches:
        st.set_loop_position({"epoch_index": 0, "batches_into_epoch": 0})
        return
    per_epoch = max(math.ceil(batches / k), 1)
    st.set_loop_position({"epoch_index": st.global_step // per_epoch, "batches_into_epoch": (st.global_step % per_epoch) * k})
