"""Checkpoints that never lose work.

A checkpoint is written into `.checkpoint-<step>.tmp`, every file fsynced, a `COMPLETE` marker
(listing each file and its size) written last, then the folder is renamed to `checkpoint-<step>`.
Resume only trusts folders whose marker exists and whose files match it; rotation deletes old
checkpoints only after the new one is in place, and never the best one."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch

from kiln.engine.errors import CheckpointError, safe_torch_load
from kiln.engine.seed import rng_state, set_rng_state
from kiln.engine.state import TrainerState

if TYPE_CHECKING:
    from kiln.engine.trainer import Trainer

PREFIX = "checkpoint-"
MARKER = "COMPLETE"
STATE = "trainer_state.json"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


def _fsync_tree(directory: str) -> dict[str, int]:
    """fsync every file (so the marker never outlives its data after a crash); return sizes."""
    sizes: dict[str, int] = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    return sizes


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path: str) -> bool:
    """True when `path` has a marker and every file it lists exists with the recorded size."""
    marker = os.path.join(path, MARKER)
    try:
        with open(marker, encoding="utf-8") as fh:
            meta = json.load(fh)
        return all(os.path.getsize(os.path.join(path, f)) == size for f, size in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_marker(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MARKER), encoding="utf-8") as fh:
        return json.load(fh)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-<step>` folder, oldest first (complete or not)."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir) if (m := _STEP.match(name))]
    return sorted(found)


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """Newest complete checkpoint; incomplete ones are skipped with a warning."""
    for step, path in reversed(list_checkpoints(output_dir)):
        if is_complete(path):
            return path
        warnings.warn(f"Ignoring incomplete checkpoint {path} (no valid {MARKER} marker).", stacklevel=2)
    return None


def resolve_resume(resume: Any, output_dir: str) -> Optional[str]:
    """`True` / "true" -> newest complete checkpoint (None if there is none); a path -> that path."""
    if resume is None or resume is False or (isinstance(resume, str) and resume.lower() in ("", "false", "none")):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() == "true"):
        path = latest_checkpoint(output_dir)
        if path is None:
            warnings.warn(f"resume_from_checkpoint=True but {output_dir} has no complete checkpoint: starting fresh.", stacklevel=2)
        return path
    path = os.fspath(resume)
    if not os.path.isdir(path):
        raise CheckpointError(f"resume_from_checkpoint={path!r} is not a folder.")
    if not is_complete(path):
        raise CheckpointError(f"{path} is incomplete or damaged (its {MARKER} marker is missing or does not match its files).")
    return path


class CheckpointManager:
    """Saves, rotates and loads checkpoints for one Trainer."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    # -- save -------------------------------------------------------------------------------
    def save(self, metrics: Optional[dict[str, float]] = None) -> str:
        t = self.trainer
        cfg, strategy, state = t.config, t.strategy, t.state
        out = cfg.output_dir
        final = os.path.join(out, f"{PREFIX}{state.global_step}")
        tmp = os.path.join(out, f".{PREFIX}{state.global_step}.tmp")
        writer = strategy.is_global_zero or (cfg.save.on_each_node and strategy.is_local_zero)
        if writer:
            os.makedirs(out, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a run killed while saving
            os.makedirs(tmp)
        strategy.barrier("checkpoint-mkdir")
        only_model = cfg.save.only_model
        io = strategy.checkpoint_io()
        io.save(tmp, t.model, t.optimizer, save_optimizer=not only_model, safetensors=cfg.save.safetensors, writer=writer)
        if not only_model:
            torch.save(rng_state(), os.path.join(tmp, f"rng_state_{strategy.global_rank}.pth"))
        if writer:
            if state.best_global_step == state.global_step:
                state.best_model_checkpoint = final
            if not only_model:
                if t.lr_scheduler is not None:
                    torch.save(t.lr_scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
                torch.save(t.precision.state_dict(), os.path.join(tmp, "precision.pt"))
            state.stateful_callbacks = t.callback_handler.state_dict()
            state.save_to_json(os.path.join(tmp, STATE))
            from omegaconf import OmegaConf

            OmegaConf.save(t.config, os.path.join(tmp, "config.yaml"))
        strategy.barrier("checkpoint-written")
        if writer:
            meta = {"step": state.global_step, "world_size": strategy.world_size, "format": io.format,
                    "resumable": not only_model, "files": _fsync_tree(tmp)}
            with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as fh:
                json.dump(meta, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            if os.path.exists(final):  # same step saved twice (e.g. eval + end of training)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(out)
            self.rotate()
        strategy.barrier("checkpoint-done")
        return final

    def rotate(self) -> None:
        """Keep the newest `total_limit` complete checkpoints; the best one is always kept, and counts
        towards the limit unless the limit is 1 (HF: limit 5 keeps the 4 newest plus the best)."""
        cfg, state = self.trainer.config, self.trainer.state
        limit = cfg.save.total_limit
        if not limit:
            return
        complete = [os.path.abspath(p) for _, p in list_checkpoints(cfg.output_dir) if is_complete(p)]
        best = os.path.abspath(state.best_model_checkpoint) if state.best_model_checkpoint else None
        keep = set(complete[-limit:])
        if best in complete and best not in keep:
            keep = set(complete[-(limit - 1):]) if limit > 1 else keep
            keep.add(best)
        for path in complete:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # -- load -------------------------------------------------------------------------------
    def load(self, path: str) -> None:
        """Restore everything a checkpoint holds into the (already set-up) trainer."""
        t = self.trainer
        meta = read_marker(path)
        if not meta.get("resumable", True):
            raise CheckpointError(f"{path} was saved with save_only_model=true and cannot be resumed; load its weights instead.")
        io = t.strategy.checkpoint_io()
        if meta.get("format", "full") != io.format:
            raise CheckpointError(
                f"{path} was saved by a strategy with the {meta.get('format')!r} checkpoint format, but this run uses "
                f"{io.format!r}; resume with the strategy that saved it."
            )
        if io.format != "full" and meta.get("world_size") != t.strategy.world_size:
            raise CheckpointError(
                f"{path} holds shards for {meta.get('world_size')} processes but this run has {t.strategy.world_size}; "
                "resume with the same number of processes."
            )
        io.load(path, t.model, t.optimizer)
        sched = os.path.join(path, "scheduler.pt")
        if t.lr_scheduler is not None and os.path.exists(sched):
            t.lr_scheduler.load_state_dict(safe_torch_load(sched))
        prec = os.path.join(path, "precision.pt")
        if os.path.exists(prec):
            t.precision.load_state_dict(safe_torch_load(prec))
        try:
            t.state = TrainerState.load_from_json(os.path.join(path, STATE))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}/{STATE} is unreadable ({err}).") from None
        # Callback state (early-stopping patience, ...) is part of exact resume.
        t.callback_handler.load_state_dict(t.state.stateful_callbacks)
        rng = os.path.join(path, f"rng_state_{t.strategy.global_rank}.pth")
        if os.path.exists(rng):
            self.pending_rng = safe_torch_load(rng)
        else:
            warnings.warn(f"{rng} is missing: random streams are not restored, results will differ from an uninterrupted run.", stacklevel=2)

    pending_rng: Optional[dict[str, Any]] = None

    def restore_rng(self) -> None:
        """Called by the loop right before the first resumed batch, so nothing in between draws."""
        if self.pending_rng is not None:
            set_rng_state(self.pending_rng)
            self.pending_rng = None
