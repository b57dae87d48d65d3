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
from kiln.engine.checkpoint.restored import Restored
from kiln.engine.data.loaders import loader_length
from kiln.engine.model.peft import checkpoint_io_for
from kiln.engine.seed import _py_state_to_plain
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.param_groups import regroup_optimizer_state

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


def load_hf_checkpoint(manager: Any, path: str) -> Restored:
    """Restore what an HF checkpoint holds into the (already set-up) run, and say what was not.
    `manager` is the run's CheckpointManager; returns its `Restored`."""
    run = manager.run
    restored, missing = ["weights"], []
    io = checkpoint_io_for(manager.strategy, run.model)  # HF saved a PeftModel's adapter only
    io.load_weights_only(path, model=run.wrapped, module=run.model)
    if run.optimizer is not None and os.path.exists(os.path.join(path, "optimizer.pt")):
        try:
            saved = safe_torch_load(os.path.join(path, "optimizer.pt"))  # HF: two groups, even without decay
            run.optimizer.load_state_dict(regroup_optimizer_state(saved, run.optimizer.param_groups))
            restored.append("optimizer")
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{path}/optimizer.pt does not fit this run's optimizer ({err}); use the optim and "
                                  "weight_decay the HF run used.") from None
    else:
        missing.append("optimizer state")
    if run.scheduler is not None and os.path.exists(os.path.join(path, "scheduler.pt")):
        manager.load_scheduler(path, "use the lr_scheduler_type the HF run used.")
        restored.append("scheduler")
    elif run.scheduler is not None:
        missing.append("scheduler state")
    try:
        state = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}/trainer_state.json is unreadable ({err}).") from None
    restored.append("trainer state (step, log history, best metric)")
    _compare_cadence(state, manager.config, path)
    if manager.load_callback_state(path, state):
        restored.append("callback state")
    rank = manager.strategy.global_rank
    rng_file = next((os.path.join(path, n) for n in (f"rng_state_{rank}.pth", "rng_state.pth")
                     if os.path.exists(os.path.join(path, n))), None)
    rng = _hf_rng(rng_file) if rng_file else None
    (restored if rng is not None else missing).append("RNG state")
    _set_position(state, run.accumulation, manager.loader)
    missing += ["the sampler position (kiln's sampler orders samples differently from HF's; the epoch position is kept)",
                "the running loss sums of the interrupted logging window"]
    if os.path.exists(os.path.join(path, "scaler.pt")):
        missing.append("the fp16 grad scaler (scaler.pt)")
    warnings.warn(f"Resumed from Hugging Face checkpoint {path} at step {state.global_step}: restored "
                  f"{', '.join(restored)}; not restored: {'; '.join(missing)}. The run continues from here but will "
                  "not match the HF run it came from exactly.", stacklevel=3)
    return Restored(state, rng)


def _compare_cadence(st: TrainerState, cfg: Any, path: str) -> None:
    """HF's `compare_trainer_and_checkpoint_args`: warn, naming them, when the logging, eval or save
    interval differs from the one the checkpoint was trained with."""
    pairs = (("logging_steps", st.logging_steps, cfg.log.steps), ("eval_steps", st.eval_steps, cfg.eval.steps),
             ("save_steps", st.save_steps, cfg.save.steps))
    changed = [f"{name} {old!r} -> {new!r}" for name, old, new in pairs
               if new is not None and float(new) >= 1 and old is not None and int(old) != int(new)]
    if changed:
        warnings.warn(f"Resuming {path} with settings that differ from the checkpoint's ({'; '.join(changed)}): "
                      "the run continues with this run's values.", stacklevel=4)


def _set_position(st: TrainerState, k: int, loader: Any) -> None:
    """HF's rule: `global_step` full epochs of `ceil(batches / k)` steps, then the remainder in windows of k."""
    import math

    batches = loader_length(loader) if loader is not None else None
    if not batches:
        st.set_loop_position({"epoch_index": 0, "batches_into_epoch": 0})
        return
    per_epoch = max(math.ceil(batches / k), 1)
    st.set_loop_position({"epoch_index": st.global_step // per_epoch, "batches_into_epoch": (st.global_step % per_epoch) * k})
