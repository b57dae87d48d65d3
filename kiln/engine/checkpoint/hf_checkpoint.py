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
import math
import os
import warnings
from typing import Any

from kiln.engine.callbacks.state import TrainerState
from kiln.engine.checkpoint.restored import Restored
from kiln.engine.checkpoint.run_state import load_callback_state, load_scheduler
from kiln.engine.data.loaders import loader_length
from kiln.engine.model.peft import checkpoint_io_for
from kiln.engine.seed import _py_state_to_plain
from kiln.strategies.model_weights import load_weights
from kiln.strategies.portable_state import PortableState
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.hf_logging import hf_logger
from kiln.utils.param_groups import regroup_optimizer_state

log = logging.getLogger(__name__)


def _hf_rng(path: str) -> dict[str, Any] | None:
    """HF's RNG file (numpy's state is an ndarray) in kiln's layout; numpy's array types are the only
    extra globals allowed, so nothing in the file can run code."""
    import numpy as np
    import torch

    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    reconstruct = getattr(np, "_core", np.core).multiarray._reconstruct
    try:
        with torch.serialization.safe_globals([*allowed, reconstruct]):
            raw = torch.load(path, map_location="cpu", weights_only=True)
        kind, keys, pos, has_gauss, cached = raw["numpy"]
        state: dict[str, Any] = {
            "python": _py_state_to_plain(raw["python"]),
            "torch": raw["cpu"],
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(np.asarray(keys).astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            },
        }
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
    optimizer_file = os.path.join(path, "optimizer.pt")
    if run.optimizer is not None and os.path.exists(optimizer_file):
        saved = safe_torch_load(optimizer_file)  # HF: two groups, even without decay
        if io.translatable:  # HF's files are a `full` checkpoint's: into any layout (FSDP's shards too)
            full = PortableState(load_weights(path), saved)
            io.load_portable(full, module=run.model, optimizer=run.optimizer, source=path)
        else:
            io.load_weights_only(path, model=run.wrapped, module=run.model)
            try:
                run.optimizer.load_state_dict(regroup_optimizer_state(saved, run.optimizer.param_groups))
            except (ValueError, KeyError) as err:
                raise CheckpointError(
                    f"{path}/optimizer.pt does not fit this run's optimizer ({err}); use the optim and "
                    "weight_decay the HF run used."
                ) from None
        restored.append("optimizer")
    else:
        io.load_weights_only(path, model=run.wrapped, module=run.model)
        missing.append("optimizer state")
    if run.scheduler is not None and os.path.exists(os.path.join(path, "scheduler.pt")):
        load_scheduler(manager, path, "use the lr_scheduler_type the HF run used.")
        restored.append("scheduler")
    elif run.scheduler is not None:
        missing.append("scheduler state")
    try:
        state = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}/trainer_state.json is unreadable ({err}).") from None
    restored.append("trainer state (step, log history, best metric)")
    compare_with_checkpoint(state, manager, path)
    if load_callback_state(manager, path, state):
        restored.append("callback state")
    rank = manager.strategy.global_rank
    rng_file = next(
        (
            os.path.join(path, n)
            for n in (f"rng_state_{rank}.pth", "rng_state.pth")
            if os.path.exists(os.path.join(path, n))
        ),
        None,
    )
    rng = _hf_rng(rng_file) if rng_file else None
    (restored if rng is not None else missing).append("RNG state")
    _set_position(state, run.accumulation, manager.loader)
    missing += [
        "the sampler position (kiln's sampler orders samples differently from HF's; the epoch position is kept)",
        "the running loss sums of the interrupted logging window",
    ]
    if os.path.exists(os.path.join(path, "scaler.pt")):
        missing.append("the fp16 grad scaler (scaler.pt)")
    warnings.warn(
        f"Resumed from Hugging Face checkpoint {path} at step {state.global_step}: restored "
        f"{', '.join(restored)}; not restored: {'; '.join(missing)}. The run continues from here but will "
        "not match the HF run it came from exactly.",
        stacklevel=3,
    )
    return Restored(state, rng)


def compare_with_checkpoint(saved: TrainerState, manager: Any, path: str) -> None:
    """HF's `compare_trainer_and_checkpoint_args`, for kiln's checkpoints and HF's alike: one warning
    (kiln's logger, HF's words) naming each of logging_steps, eval_steps, save_steps and
    per_device_train_batch_size whose value in this run differs from the one the checkpoint's
    trainer_state.json records. The run goes on with this run's values. A ratio (below 1) is compared
    as the number of steps it comes to in this run: HF compares the ratio itself with the saved count,
    which warns when nothing changed."""
    cfg, run = manager.config, manager.run
    max_steps = _max_steps(cfg, run.accumulation, manager.loader)
    lines = []
    # evaluation by steps without eval_steps evaluates every logging_steps, which HF's arguments then hold as eval_steps
    eval_steps = cfg.eval.steps if cfg.eval.steps is not None or cfg.eval.strategy != "steps" else cfg.log.steps
    for name, value in (("logging_steps", cfg.log.steps), ("eval_steps", eval_steps), ("save_steps", cfg.save.steps)):
        old = getattr(saved, name, None)
        if value is None or old is None:  # HF: compared only where both are set
            continue
        steps = int(value) if value >= 1 else (math.ceil(max_steps * value) if max_steps else None)
        if steps is not None and steps != int(old):
            shown = int(value) if float(value).is_integer() else value  # 2, not the config's 2.0
            lines.append(f"{name}: {shown} (from args) != {old} (from trainer_state.json)")
    if saved.train_batch_size and saved.train_batch_size != run.micro_batch_size:  # both per device (no DataParallel)
        lines.append(
            f"per_device_train_batch_size: {run.micro_batch_size} (from args) != {saved.train_batch_size} "
            "(from trainer_state.json)"
        )
    if lines:  # HF's warning, on its logger
        listed = "".join(f"\n\t{line}" for line in lines)
        hf_logger("transformers.trainer_utils", log).warning(
            "Warning: The following arguments do not match the ones in the `trainer_state.json` within the checkpoint "
            f"directory {path} (the run continues with this run's values): {listed}"
        )


def _max_steps(cfg: Any, accumulation: int, loader: Any) -> int | None:
    """This run's total steps (HF's rule, kiln.engine.loop.plan), which a ratio of steps is of."""
    from kiln.engine.loop.plan import plan_steps

    try:
        return plan_steps(cfg, accumulation, loader_length(loader) if loader is not None else None)[0]
    except ValueError:  # no length and no max_steps: fit() refuses it itself, with its own sentence
        return None


def _set_position(st: TrainerState, k: int, loader: Any) -> None:
    """HF's rule: `global_step` full epochs of `ceil(batches / k)` steps, then the remainder in windows of k."""
    import math

    batches = loader_length(loader) if loader is not None else None
    if not batches:
        st.set_loop_position({"epoch_index": 0, "batches_into_epoch": 0})
        return
    per_epoch = max(math.ceil(batches / k), 1)
    st.set_loop_position(
        {"epoch_index": st.global_step // per_epoch, "batches_into_epoch": (st.global_step % per_epoch) * k}
    )
