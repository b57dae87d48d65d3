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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from kiln.engine.callbacks.state import TrainerState
from kiln.engine.checkpoint.background import BackgroundSave
from kiln.engine.checkpoint.data_position import stateful_dataset
from kiln.engine.checkpoint.files import (
    MARKER,
    PREFIX,
    _fsync_dir,
    _fsync_tree,
    _remove,
    is_complete,
    kept,
    latest_checkpoint,
    list_checkpoints,
    read_marker,
)
from kiln.engine.checkpoint.hf_files import write_model_files, write_training_args
from kiln.engine.checkpoint.integrity import ALGORITHM, VERSION
from kiln.engine.checkpoint.remote import RemoteCheckpoints
from kiln.engine.checkpoint.remote_run import publish, store_of, upload_outputs
from kiln.engine.checkpoint.restored import Restored
from kiln.engine.checkpoint.saved_config import CONFIG, changed_settings
from kiln.engine.checkpoint.signing import SIGNATURE, sign, signing_key
from kiln.engine.checkpoint.write_errors import write_errno, write_failure
from kiln.engine.model.peft import checkpoint_io_for
from kiln.engine.seed import rng_state
from kiln.strategies.checkpoint_io import StagedWrite
from kiln.strategies.weights_files import tie_groups
from kiln.utils.errors import CheckpointError, safe_torch_load
from kiln.utils.hf_logging import hf_logger
from kiln.utils.host_copy import HostStaging
from kiln.utils.param_groups import regroup_scheduler_state

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.engine.hooks import Stateful
    from kiln.engine.run import Run
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)

STATE = "trainer_state.json"
#: kiln's loop position (epoch, batches into it): kept out of trainer_state.json, whose schema is HF's
POSITION = "kiln_loop_position.json"
RNG = "rng_state_{rank}.pth"
LOOP = "loop_state_{rank}.pt"
_DEBRIS = re.compile(rf"^\.{PREFIX}\d+\.(tmp|old|deleting)$")
#: config keys whose change makes the saved data position mean something else (warned about on resume)
_POSITION_KEYS = (
    "data.per_device_train_batch_size",
    "train.gradient_accumulation_steps",
    "seed",
    "data_seed",
    "data.dataloader_drop_last",
    "data.group_by_length",
)


def _plain(value: Any) -> bool:
    """Whether `value` survives `torch.load(weights_only=True)` (tensors, numbers, str, containers)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


def _save(obj: Any, path: str) -> None:
    """torch.save through an open file: a failed write then keeps its OSError (errno) as the error's
    context, where torch's own file writer only says "unexpected pos" (write_errors)."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)


class CheckpointManager:
    """Saves, rotates and loads the checkpoints of one training run."""

    def __init__(
        self,
        config: DictConfig,
        strategy: Strategy,
        precision: Precision,
        callbacks: CallbackHandler,
        run: Run,
        training_args: Any = None,
    ) -> None:
        self.config, self.strategy, self.precision, self.callbacks, self.run = (
            config,
            strategy,
            precision,
            callbacks,
            run,
        )
        self.training_args = training_args  # the user's TrainingArguments, written as training_args.bin (HF)
        self.loop: Stateful | None = None
        self.loader: Iterable[Any] | None = None
        self.saved_step: int | None = None  # the step of the last checkpoint this process wrote
        self.preempted_step: int | None = None  # set when SIGTERM stopped the run after saving this step
        self._debris_cleared = False
        self._background = BackgroundSave()  # the save in flight with save.async_save
        self._staging = HostStaging()  # its host copy, in buffers reused from save to save
        self._said_synchronous = False  # the one log line of a format that cannot save in the background
        self.signing_key = signing_key(config.save.signing_key_env)  # fails here, before training, when unset
        self._store: RemoteCheckpoints | None = None  # save.remote_dir's, built at the first upload

    def attach(self, loop: Stateful, loader: Iterable[Any]) -> None:
        """The fit loop registers itself and its train loader: both have per-rank state to save."""
        self.loop, self.loader = loop, loader

    # -- save -------------------------------------------------------------------------------
    def save(self, state: TrainerState) -> str:
        """Write `checkpoint-<global_step>` atomically (every rank calls this); returns its path.

        With `save.async_save` the weights and optimizer state are copied to host memory here and the
        rest of the save (writing them, fsync, the marker, the rename, rotation) runs in the background
        (kiln.engine.checkpoint.background): the folder appears when it is complete, and `wait()`
        raises its failure."""
        self.wait()  # at most one save in flight
        cfg, strategy = self.config, self.strategy
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
        io = checkpoint_io_for(strategy, self.run.model)  # a PeftModel: its adapter only (HF)
        try:
            staged = self._stage(io, writer)
            if staged is None:
                self._io_save(io, tmp, writer)
            self._write(tmp, writer, state)
            strategy.barrier("checkpoint-written")
            meta = self._marker(io, state) if writer else {}
            if writer and staged is None:
                self._publish(tmp, final, meta)
        except Exception as err:
            self._failed(err, tmp, final, writer)
            raise
        self.saved_step = state.global_step
        best = state.best_model_checkpoint
        if staged is not None:
            if writer:
                self._background.start(state.global_step, lambda: self._complete(staged, tmp, final, meta, best))
                if self.callbacks.reads_checkpoint_on_save():  # on_save must find the folder (artifacts, Ray)
                    self._background.finish()
            return final
        if writer:
            self._published(final, best)
        strategy.barrier("checkpoint-done")
        return final

    def _stage(self, io: Any, writer: bool) -> StagedWrite | None:
        """The host copy of the model and optimizer files for a background write, or None to write them now."""
        cfg, run = self.config, self.run
        if not cfg.save.async_save:
            return None
        staged = io.stage(
            model=run.wrapped,
            module=run.model,
            optimizer=run.optimizer,
            save_optimizer=not cfg.save.only_model,
            safetensors=cfg.save.safetensors,
            writer=writer,
            staging=self._staging,
        )
        if staged is None and not self._said_synchronous:
            log.warning(
                "save.async_save: the %r checkpoint format cannot be written in the background yet, so its "
                "checkpoints are saved synchronously.",
                io.format,
            )
            self._said_synchronous = True
        return staged

    def _io_save(self, io: Any, tmp: str, writer: bool) -> None:
        cfg, run = self.config, self.run
        io.save(
            tmp,
            model=run.wrapped,
            module=run.model,
            optimizer=run.optimizer,
            save_optimizer=not cfg.save.only_model,
            safetensors=cfg.save.safetensors,
            writer=writer,
        )

    def _marker(self, io: Any, state: TrainerState) -> dict[str, Any]:
        """What COMPLETE records besides the files (which `_publish` adds)."""
        meta = {
            "version": VERSION,
            "step": state.global_step,
            "world_size": self.strategy.world_size,
            "format": io.format,
            "resumable": not self.config.save.only_model,
        }
        if ties := tie_groups(self.run.model):  # `kiln convert` stores each tie once again (weights_files)
            meta["tied"] = ties
        return meta

    def _complete(self, staged: StagedWrite, tmp: str, final: str, meta: dict[str, Any], best: str | None) -> None:
        """The background half of an asynchronous save, on the writer: the staged files, then exactly
        what a synchronous save does after them."""
        try:
            staged(tmp)
            self._publish(tmp, final, meta)
        except Exception as err:
            self._failed(err, tmp, final, True)
            raise
        self._published(final, best)

    def _published(self, final: str, best: str | None) -> None:
        """The one place a complete checkpoint is announced, on the writer: local rotation, then, for a run
        with an object store (save.remote_dir), its upload and the store's rotation (remote_run.publish),
        from global rank 0."""
        self.rotate(best)
        if self.store is not None and self.strategy.is_global_zero:
            publish(self.store, final, self.config.save.total_limit, best)

    @property
    def store(self) -> RemoteCheckpoints | None:
        """The run's object store (save.remote_dir), or None."""
        if self._store is None and self.config.save.remote_dir:
            self._store = store_of(self.config)
        return self._store

    def upload_outputs(self) -> None:
        """Upload the files at the top of output_dir (the exported model, trainer_state.json) to the run's
        store, from global rank 0; nothing for a run without one."""
        if self.store is not None and self.strategy.is_global_zero:
            upload_outputs(self.store, str(self.config.output_dir))

    def _failed(self, err: BaseException, tmp: str, final: str, writer: bool) -> None:
        """Clean up after a failed write and raise the one-sentence error of a file-system failure;
        anything else the caller raises as it is."""
        out = os.path.dirname(final)
        code = write_errno(err, tmp if os.path.isdir(tmp) else out)
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoints are untouched
        if code is not None:
            raise CheckpointError(write_failure(code, os.path.basename(final), out, latest_checkpoint(out))) from None

    def wait(self) -> None:
        """Block until the save in flight (save.async_save) is complete on every rank; raise its failure,
        the same sentence on every rank. Every rank calls this at the same points: before a save, at the
        end of fit and at a preemption. Without save.async_save there is nothing to wait for."""
        if not self.config.save.async_save:
            return
        error = self._background.join()
        message = None if error is None else str(error)
        if self.strategy.world_size > 1:  # only the writers write in the background: tell every rank
            messages = [m for m in self.strategy.all_gather_object(message) if m]
            message = messages[0] if messages else None
        if error is not None:
            raise error
        if message is not None:
            raise CheckpointError(message)

    def drain(self) -> None:
        """Let the save in flight finish when fit ends on an error of its own: no collective, and a
        failure of the save is logged rather than raised over that error."""
        error = self._background.join()
        if error is not None:
            log.error("The background save of checkpoint-%s failed too: %s", self._background.step, error)

    def _write(self, tmp: str, writer: bool, state: TrainerState) -> None:
        """Every file of the checkpoint but the model and optimizer: per-rank state on every rank, the rest
        on the writer. Small files, written here also by an asynchronous save."""
        cfg, run = self.config, self.run
        only_model = cfg.save.only_model
        if not only_model:
            rank = self.strategy.global_rank
            _save(rng_state(), os.path.join(tmp, RNG.format(rank=rank)))
            _save(self._loop_state(), os.path.join(tmp, LOOP.format(rank=rank)))
        if not writer:
            return
        if not only_model:
            if run.scheduler is not None:
                _save(run.scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
            _save(self.precision.state_dict(), os.path.join(tmp, "precision.pt"))
        state.stateful_callbacks = self.callbacks.state_dict(self.run.control)
        state.save_to_json(os.path.join(tmp, STATE))
        with open(os.path.join(tmp, POSITION), "w", encoding="utf-8") as fh:
            json.dump(state.loop_position(), fh)
        from omegaconf import OmegaConf

        OmegaConf.save(self.config_to_save(), os.path.join(tmp, CONFIG))
        # HF's files (kiln.engine.checkpoint.hf_files): from_pretrained(checkpoint) works, tools find their files
        write_model_files(tmp, run.model, self.callbacks.objects.get("processing_class"))
        write_training_args(tmp, self.config, self.training_args)

    def config_to_save(self) -> Any:
        """The run's config as config.yaml keeps it (a DictConfig of `saved_tree`)."""
        from omegaconf import OmegaConf

        return OmegaConf.create(self.saved_tree())

    def saved_tree(self) -> dict[str, Any]:
        """The run's config as plain containers: `${oc.env:...}` values masked, and the live micro-batch
        size and accumulation (auto_find_batch_size may have changed them), which a resumed run adopts."""
        from kiln.config.redact import config_for_saving

        saved = config_for_saving(self.config)
        saved["data"]["per_device_train_batch_size"] = self.run.micro_batch_size
        saved["train"]["gradient_accumulation_steps"] = self.run.accumulation
        return saved

    def _publish(self, tmp: str, final: str, meta: dict[str, Any]) -> None:
        """fsync everything, write the marker last (signed with save.signing_key_env's key), then rename
        the folder into place."""
        meta["files"], meta[ALGORITHM] = _fsync_tree(tmp)
        if self.signing_key is not None:
            meta[SIGNATURE] = sign(meta, self.signing_key)
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

    def rotate(self, best_checkpoint: str | None) -> None:
        """Keep the newest `total_limit` complete checkpoints; the best one (`best_checkpoint`) is always
        kept, and counts towards the limit unless the limit is 1 (HF: limit 5 keeps the 4 newest plus the
        best; limit 1 keeps the newest and the best)."""
        cfg = self.config
        limit = cfg.save.total_limit
        if not limit:
            return
        complete = [os.path.abspath(p) for _, p in list_checkpoints(cfg.output_dir) if is_complete(p)]
        keep = kept(complete, limit, os.path.abspath(best_checkpoint) if best_checkpoint else None)
        for path in complete:
            if path not in keep:
                _remove(path)

    # -- load -------------------------------------------------------------------------------
    def load(self, path: str) -> Restored:
        """Load the weights, optimizer, schedule and precision state of `path` into the (already set-up)
        run; return the trainer state and what the loop applies later (see Restored)."""
        from kiln.engine.checkpoint.files import is_hf_checkpoint
        from kiln.engine.checkpoint.hf_checkpoint import compare_with_checkpoint, load_hf_checkpoint

        if is_hf_checkpoint(path):  # written by HF's Trainer: restore what it holds, say what it does not
            return load_hf_checkpoint(self, path)
        strategy, run = self.strategy, self.run
        meta = read_marker(path)
        if not meta.get("resumable", True):
            raise CheckpointError(
                f"{path} was saved with save_only_model=true and cannot be resumed; load its weights instead."
            )
        io = checkpoint_io_for(strategy, self.run.model)  # a PeftModel: its adapter only (HF)
        if not io.resumes(meta.get("format", "full")):
            raise CheckpointError(
                f"{path} was saved by a strategy with the {meta.get('format')!r} checkpoint format, but this run uses "
                f"{io.format!r}; resume with the strategy that saved it."
            )
        saved_world = meta.get("world_size")
        if saved_world != strategy.world_size:
            if not io.reshardable:
                raise CheckpointError(
                    f"{path} holds shards for {saved_world} processes but this run has {strategy.world_size}; "
                    f"the {io.format!r} format cannot be resharded: resume with {saved_world} processes."
                )
            warnings.warn(
                f"{path} was saved by {saved_world} processes and this run has {strategy.world_size}: weights, optimizer "
                "and schedule are restored, but each rank's data position and random streams cannot be, so the run "
                "will not match an uninterrupted one.",
                stacklevel=2,
            )
        self._check_config(path)
        assert run.wrapped is not None  # Run.__post_init__ sets it, and nothing sets it back to None
        io.load(path, model=run.wrapped, module=run.model, optimizer=run.optimizer)
        self.load_scheduler(path, "was scheduler.name changed?")
        prec = os.path.join(path, "precision.pt")
        if os.path.exists(prec):
            self.precision.load_state_dict(safe_torch_load(prec))
        try:
            state = TrainerState.load_from_json(os.path.join(path, STATE))
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{path}/{STATE} is unreadable ({err}).") from None
        compare_with_checkpoint(state, self, path)  # HF's warning: logging/eval/save steps or batch size changed
        self._load_position(path, state)
        self.load_callback_state(path, state)  # early-stopping counters, ...: part of exact resume
        rank = strategy.global_rank
        rng_file = os.path.join(path, RNG.format(rank=rank))
        rng = safe_torch_load(rng_file) if os.path.exists(rng_file) else None
        if rng is None:
            warnings.warn(
                f"{rng_file} is missing: random streams are not restored, results will differ from an "
                "uninterrupted run.",
                stacklevel=2,
            )
        loop_file = os.path.join(path, LOOP.format(rank=rank))
        loop = safe_torch_load(loop_file) if os.path.exists(loop_file) else {}
        log.info(
            "Resuming from %s: step %d, epoch %d, %d batches into the epoch.",
            path,
            state.global_step,
            state.epoch_index,
            state.batches_into_epoch,
        )
        return Restored(state, rng, loop.get("loop"), loop.get("dataset"))

    def load_scheduler(self, path: str, hint: str) -> bool:
        """The schedule's state from `path/scheduler.pt` (in either param-group layout); False when absent."""
        run = self.run
        sched = os.path.join(path, "scheduler.pt")
        if run.scheduler is None:
            return False
        if not os.path.exists(sched):
            warnings.warn(f"{sched} is missing: the learning-rate schedule restarts from its beginning.", stacklevel=3)
            return False
        try:
            saved = safe_torch_load(sched)
            if run.optimizer is not None:  # saved in the other param-group layout (kiln.utils.param_groups)
                saved = regroup_scheduler_state(saved, len(run.optimizer.param_groups))
            run.scheduler.load_state_dict(saved)
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"{sched} does not fit this run's scheduler {type(run.scheduler).__name__} ({err}); {hint}"
            ) from None
        return True

    def load_callback_state(self, path: str, state: TrainerState) -> bool:
        """Give each callback its saved state; warn about state no callback of this run takes."""
        callbacks = {
            k: v for k, v in (state.stateful_callbacks or {}).items() if k != "TrainerControl"
        }  # HF's; not kept
        missing = self.callbacks.load_state_dict(
            callbacks, restore_args=bool(self.config.save.restore_callback_states_from_checkpoint)
        )
        if missing:  # HF's _load_callback_state's warning, on its logger
            hf_logger("transformers.trainer", log).warning(
                f"Checkpoint included callbacks not included in current configuration. Ignoring. ({', '.join(missing)}: "
                f"{path} holds their state, and this run has no such callback)"
            )
        return bool(callbacks)

    def _load_position(self, path: str, state: TrainerState) -> None:
        """The loop position from its own file; checkpoints of older kiln versions kept it inside
        trainer_state.json, which `TrainerState.load_from_json` has already read."""
        file = os.path.join(path, POSITION)
        if not os.path.exists(file):
            return
        try:
            with open(file, encoding="utf-8") as fh:
                state.set_loop_position(json.load(fh))
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{file} is unreadable ({err}).") from None

    def _check_config(self, path: str) -> None:
        """Warn when a setting that decides the data position changed since the checkpoint. The saved
        config.yaml is data: read without resolving anything, compared as text (saved_config)."""
        if moved := changed_settings(path, self.saved_tree(), _POSITION_KEYS):
            warnings.warn(
                f"Resuming {path} with changed settings ({'; '.join(moved)}): the data position saved in the "
                "checkpoint no longer points at the same samples, so the run will not match an uninterrupted one.",
                stacklevel=3,
            )
