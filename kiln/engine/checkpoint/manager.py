"""Checkpoints that never lose work.

A checkpoint is written into `.checkpoint-<step>.tmp`, every file fsynced, a `COMPLETE` marker
(listing each file and its size) written last, then the folder is renamed to `checkpoint-<step>`.
Resume only trusts folders whose marker exists and whose files match it; rotation deletes old
checkpoints only after the new one is in place, and never the best one.

Per rank, a checkpoint holds `rng_state_<rank>.pth` (python, numpy, torch CPU and CUDA streams) and
`loop_state_<rank>.pt` (the fit loop's running loss sums and, for iterable datasets that provide
`state_dict()`, the dataset's position). Everything is read back with `weights_only=True`,
safetensors or JSON: nothing in a checkpoint can run code."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

from kiln.engine.checkpoint.files import (  # noqa: F401  (re-exported: the Trainer and tests import them from here)
    MARKER, PREFIX, _fsync_dir, _fsync_tree, _remove, is_complete, latest_checkpoint, list_checkpoints, read_marker,
    resolve_resume,
)
from kiln.engine.checkpoint.integrity import ALGORITHM
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.param_groups import regroup_scheduler_state
from kiln.engine.seed import rng_state, set_rng_state
from kiln.engine.callbacks.state import TrainerState

if TYPE_CHECKING:
    from kiln.engine.protocols import Stateful, TrainerLike

log = logging.getLogger(__name__)

STATE = "trainer_state.json"
#: kiln's loop position (epoch, batches into it): kept out of trainer_state.json, whose schema is HF's
POSITION = "kiln_loop_position.json"
CONFIG = "config.yaml"
RNG = "rng_state_{rank}.pth"
LOOP = "loop_state_{rank}.pt"
_DEBRIS = re.compile(rf"^\.{PREFIX}\d+\.(tmp|old|deleting)$")
#: config keys whose change makes the saved data position mean something else (warned about on resume)
_POSITION_KEYS = ("data.per_device_train_batch_size", "train.gradient_accumulation_steps", "seed", "data_seed",
                  "data.dataloader_drop_last", "data.group_by_length")
#: further settings HF compares with the checkpoint's on resume (`compare_trainer_and_checkpoint_args`)
_CADENCE_KEYS = ("log.steps", "eval.steps", "save.steps")


def _plain(value: Any) -> bool:
    """Whether `value` survives `torch.load(weights_only=True)` (tensors, numbers, str, containers)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


# -- iterable datasets ---------------------------------------------------------------------------
def stateful_dataset(loader: Iterable[Any]) -> Any:
    """The loader's iterable dataset when it can save and restore its own position, else None.

    Only with `dataloader_num_workers=0`: worker processes prefetch, so the main process's copy of
    the dataset would not know how far the loop really got."""
    from torch.utils.data import IterableDataset

    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, IterableDataset) or int(getattr(loader, "num_workers", 0) or 0):
        return None
    if callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None)):
        return dataset
    return None


def disk_full(err: BaseException, directory: str) -> bool:
    """Whether a failed write ran out of disk space. The writers say so differently (OSError errno 28,
    safetensors' "os error 28", torch.save's bare "unexpected pos"), so the file system is asked too."""
    import errno

    seen: Optional[BaseException] = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen) or "os error 28" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(directory).free < (16 << 20)
    except OSError:
        return False


class CheckpointManager:
    """Saves, rotates and loads checkpoints for one Trainer."""

    def __init__(self, trainer: TrainerLike) -> None:
        self.trainer = trainer
        self.loop: Optional[Stateful] = None
        self.loader: Optional[Iterable[Any]] = None
        self.pending_rng: Optional[dict[str, Any]] = None
        self.pending_loop: Optional[dict[str, Any]] = None
        self.saved_step: Optional[int] = None  # the step of the last checkpoint this process wrote
        self._debris_cleared = False

    def attach(self, loop: Stateful, loader: Iterable[Any]) -> None:
        """The fit loop registers itself and its train loader: both have per-rank state to save."""
        self.loop, self.loader = loop, loader

    # -- save -------------------------------------------------------------------------------
    def save(self, metrics: Optional[dict[str, float]] = None) -> str:
        """Write `checkpoint-<global_step>` atomically (every rank calls this); returns its path.
        `metrics` is accepted for HF's signature: the best metric is already in the state."""
        t = self.trainer
        cfg, strategy, state = t.config, t.strategy, t.state
        out = cfg.output_dir
        final = os.path.join(out, f"{PREFIX}{state.global_step}")
        tmp = os.path.join(out, f".{PREFIX}{state.global_step}.tmp")
        writer = strategy.is_global_zero or (cfg.save.on_each_node and strategy.is_local_zero)
        if writer:
            os.makedirs(out, exist_ok=True)
            self._clear_debris(out)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        strategy.barrier("checkpoint-mkdir")
        if state.best_global_step == state.global_step:  # every rank: load_best_model_at_end needs it
            state.best_model_checkpoint = final
        io = strategy.checkpoint_io()
        try:
            self._write(tmp, io, writer)
            strategy.barrier("checkpoint-written")
            if writer:
                self._publish(tmp, final, {"step": state.global_step, "world_size": strategy.world_size,
                                           "format": io.format, "resumable": not cfg.save.only_model})
        except Exception as err:
            if disk_full(err, out):
                shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoints are untouched
                last = latest_checkpoint(out)
                raise CheckpointError(
                    f"No space left on device while writing {os.path.basename(final)} in {out}; "
                    f"{'the previous checkpoint ' + os.path.basename(last) + ' is intact' if last else 'no earlier checkpoint exists'}. "
                    "Free some space (or lower save.total_limit) and resume with resume_from_checkpoint=true."
                ) from None
            raise
        if writer:
            self.rotate()
        strategy.barrier("checkpoint-done")
        self.saved_step = state.global_step
        return final

    def _write(self, tmp: str, io: Any, writer: bool) -> None:
        """Every file of the checkpoint: per-rank state on every rank, the rest on the writer."""
        t = self.trainer
        only_model = t.config.save.only_model
        io.save(tmp, model=t.model_wrapped, module=t.model, optimizer=t.optimizer, save_optimizer=not only_model,
                safetensors=t.config.save.safetensors, writer=writer)
        if not only_model:
            rank = t.strategy.global_rank
            torch.save(rng_state(), os.path.join(tmp, RNG.format(rank=rank)))
            torch.save(self._loop_state(), os.path.join(tmp, LOOP.format(rank=rank)))
        if not writer:
            return
        if not only_model:
            if t.lr_scheduler is not None:
                torch.save(t.lr_scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
            torch.save(t.precision.state_dict(), os.path.join(tmp, "precision.pt"))
        t.state.stateful_callbacks = t.callback_handler.state_dict()
        t.state.save_to_json(os.path.join(tmp, STATE))
        with open(os.path.join(tmp, POSITION), "w", encoding="utf-8") as fh:
            json.dump(t.state.loop_position(), fh)
        from omegaconf import OmegaConf

        from kiln.config.redact import config_for_saving
        OmegaConf.save(config_for_saving(t.config), os.path.join(tmp, CONFIG))  # ${oc.env:...} values masked
        to_json_file = getattr(getattr(t.model, "config", None), "to_json_file", None)
        if callable(to_json_file):  # Transformers: from_pretrained(checkpoint) works
            to_json_file(os.path.join(tmp, "config.json"))

    def _publish(self, tmp: str, final: str, meta: dict[str, Any]) -> None:
        """fsync everything, write the marker last, then rename the folder into place."""
        meta["files"], meta[ALGORITHM] = _fsync_tree(tmp)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        out = os.path.dirname(final)
        old = os.path.join(out, f".{os.path.basename(final)}.old")
        if os.path.exists(final):  # same step saved twice (e.g. a step save and the epoch-end save)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(out)
        shutil.rmtree(old, ignore_errors=True)

    def _clear_debris(self, out: str) -> None:
        """Remove hidden leftovers of a run killed while saving or rotating (once per process)."""
        if self._debris_cleared:
            return
        for name in os.listdir(out):
            if _DEBRIS.match(name):
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        self._debris_cleared = True

    def _loop_state(self) -> dict[str, Any]:
        """This rank's loop accumulators and iterable-dataset position."""
        state: dict[str, Any] = {"loop": self.loop.state_dict() if self.loop is not None else None, "dataset": None}
        dataset = stateful_dataset(self.loader) if self.loader is not None else None
        if dataset is not None:
            ds_state = dataset.state_dict()
            if not _plain(ds_state):
                raise CheckpointError(
                    f"{type(dataset).__name__}.state_dict() returned objects other than tensors, numbers, strings and "
                    "containers of them; kiln only saves state it can load back without unpickling code."
                )
            state["dataset"] = ds_state
        return state

    def rotate(self) -> None:
        """Keep the newest `total_limit` complete checkpoints; the best one is always kept, and counts
        towards the limit unless the limit is 1 (HF: limit 5 keeps the 4 newest plus the best; limit 1
        keeps the newest and the best)."""
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
                _remove(path)

    # -- load -------------------------------------------------------------------------------
    def load(self, path: str) -> None:
        """Restore everything a checkpoint holds into the (already set-up) trainer."""
        t = self.trainer
        from kiln.engine.checkpoint.hf_checkpoint import is_hf_checkpoint, load_hf_checkpoint

        if is_hf_checkpoint(path):  # written by HF's Trainer: restore what it holds, say what it does not
            return load_hf_checkpoint(self, path)
        meta = read_marker(path)
        if not meta.get("resumable", True):
            raise CheckpointError(f"{path} was saved with save_only_model=true and cannot be resumed; load its weights instead.")
        io = t.strategy.checkpoint_io()
        if meta.get("format", "full") != io.format:
            raise CheckpointError(
                f"{path} was saved by a strategy with the {meta.get('format')!r} checkpoint format, but this run uses "
                f"{io.format!r}; resume with the strategy that saved it."
            )
        saved_world = meta.get("world_size")
        if saved_world != t.strategy.world_size:
            if not io.reshardable:
                raise CheckpointError(
                    f"{path} holds shards for {saved_world} processes but this run has {t.strategy.world_size}; "
                    f"the {io.format!r} format cannot be resharded: resume with {saved_world} processes."
                )
            warnings.warn(
                f"{path} was saved by {saved_world} processes and this run has {t.strategy.world_size}: weights, optimizer "
                "and schedule are restored, but each rank's data position and random streams cannot be, so the run "
                "will not match an uninterrupted one.", stacklevel=2)
        self._check_config(path)
        io.load(path, model=t.model_wrapped, module=t.model, optimizer=t.optimizer)
        sched = os.path.join(path, "scheduler.pt")
        if t.lr_scheduler is not None and not os.path.exists(sched):
            warnings.warn(f"{sched} is missing: the learning-rate schedule restarts from its beginning.", stacklevel=2)
        elif t.lr_scheduler is not None:
            try:
                saved = safe_torch_load(sched)
                if t.optimizer is not None:  # saved in the other param-group layout (kiln.utils.param_groups)
                    saved = regroup_scheduler_state(saved, len(t.optimizer.param_groups))
                t.lr_scheduler.load_state_dict(saved)
            except (KeyError, ValueError, TypeError, AttributeError) as err:
                raise CheckpointError(f"{sched} does not fit this run's scheduler {type(t.lr_scheduler).__name__} ({err}); "
                                      "was scheduler.name changed?") from None
        prec = os.path.join(path, "precision.pt")
        if os.path.exists(prec):
            t.precision.load_state_dict(safe_torch_load(prec))
        try:
            t.state = TrainerState.load_from_json(os.path.join(path, STATE))
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{path}/{STATE} is unreadable ({err}).") from None
        self._load_position(path)
        # Callback state (early-stopping counters, ...) is part of exact resume.
        callbacks = {k: v for k, v in (t.state.stateful_callbacks or {}).items() if k != "TrainerControl"}  # HF's; not kept
        missing = t.callback_handler.load_state_dict(callbacks,
                                                     restore_args=bool(t.config.save.restore_callback_states_from_checkpoint))
        if missing:
            warnings.warn(f"{path} holds state for callbacks this run does not have ({', '.join(missing)}); it is ignored.",
                          stacklevel=2)
        rank = t.strategy.global_rank
        rng = os.path.join(path, RNG.format(rank=rank))
        if os.path.exists(rng):
            self.pending_rng = safe_torch_load(rng)
        else:
            warnings.warn(f"{rng} is missing: random streams are not restored, results will differ from an uninterrupted run.",
                          stacklevel=2)
        loop = os.path.join(path, LOOP.format(rank=rank))
        self.pending_loop = safe_torch_load(loop) if os.path.exists(loop) else None
        st = t.state
        log.info("Resuming from %s: step %d, epoch %d, %d batches into the epoch.", path, st.global_step,
                 st.epoch_index, st.batches_into_epoch)

    def _load_position(self, path: str) -> None:
        """The loop position from its own file; checkpoints of older kiln versions kept it inside
        trainer_state.json, which `TrainerState.load_from_json` has already read."""
        file = os.path.join(path, POSITION)
        if not os.path.exists(file):
            return
        try:
            with open(file, encoding="utf-8") as fh:
                self.trainer.state.set_loop_position(json.load(fh))
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{file} is unreadable ({err}).") from None

    def _check_config(self, path: str) -> None:
        """Warn when a setting that decides the data position changed since the checkpoint."""
        file = os.path.join(path, CONFIG)
        if not os.path.exists(file):
            return
        from omegaconf import OmegaConf

        try:
            saved = OmegaConf.load(file)  # YAML safe loading: plain values only
        except Exception as err:
            raise CheckpointError(f"{file} is unreadable ({err}).") from None
        def changed(keys: tuple[str, ...]) -> list[str]:
            pairs = ((key, OmegaConf.select(saved, key), OmegaConf.select(self.trainer.config, key)) for key in keys)
            return [f"{key} {old!r} -> {new!r}" for key, old, new in pairs if old != new]

        if moved := changed(_POSITION_KEYS):
            warnings.warn(f"Resuming {path} with changed settings ({'; '.join(moved)}): the data position saved in the "
                          "checkpoint no longer points at the same samples, so the run will not match an uninterrupted one.",
                          stacklevel=3)
        if cadence := changed(_CADENCE_KEYS):
            warnings.warn(f"Resuming {path} with settings that differ from the checkpoint's ({'; '.join(cadence)}): "
                          "the run continues with this run's values.", stacklevel=3)

    def restore_loop(self, loop: Stateful) -> None:
        """Called by the loop once its accumulators exist: put back the saved running sums."""
        if self.pending_loop is not None and self.pending_loop.get("loop") is not None:
            loop.load_state_dict(self.pending_loop["loop"])

    def resume_iterator(self, loader: Iterable[Any], skip: int) -> Iterator[Any]:
        """An iterator over `loader` starting `skip` batches into the epoch, by the cheapest exact route:
        kiln's sampler jumps to the batch; an iterable dataset with `state_dict()` restores its saved
        position; anything else is iterated past, with a progress note."""
        from kiln.engine.data.loaders import ResumableSampler, skip_batches

        saved = (self.pending_loop or {}).get("dataset")
        self.pending_loop = None
        if skip == 0:
            return iter(loader)
        dataset = stateful_dataset(loader)
        if dataset is not None and saved is not None:
            dataset.load_state_dict(saved)
            return iter(loader)
        if isinstance(getattr(loader, "sampler", None), ResumableSampler) and getattr(loader, "batch_size", None):
            return skip_batches(loader, skip)[0]
        return self._iterate_past(loader, skip)

    def _iterate_past(self, loader: Iterable[Any], skip: int) -> Iterator[Any]:
        t = self.trainer
        zero = t.strategy.is_global_zero
        if zero:
            dataset = getattr(loader, "dataset", None)
            why = ("its state_dict() is not used with dataloader_num_workers > 0" if callable(getattr(dataset, "state_dict", None))
                   else "the dataset has no state_dict()")
            log.warning("Resuming: skipping the first %d batches of the epoch by iterating over them (%s; set "
                        "ignore_data_skip=true to start the epoch over instead).", skip, why)
        it = iter(loader)
        bar = None
        if zero and not t.config.log.disable_tqdm and skip >= 1000:
            from tqdm.auto import tqdm

            bar = tqdm(total=skip, desc="skipping batches", unit="batch")
        for i in range(skip):
            next(it, None)
            if bar is not None and (i + 1) % 100 == 0:
                bar.update(100)
        if bar is not None:
            bar.update(skip - bar.n)
            bar.close()
        return it

    def restore_rng(self) -> None:
        """Called by the loop right before the first resumed batch, so nothing in between draws."""
        if self.pending_rng is not None:
            set_rng_state(self.pending_rng)
            self.pending_rng = None
