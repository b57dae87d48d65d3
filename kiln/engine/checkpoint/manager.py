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
import shutil
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from kiln.engine.callbacks.state import TrainerState
from kiln.engine.checkpoint.atomic import clear_debris, publish_folder
from kiln.engine.checkpoint.background import BackgroundSave
from kiln.engine.checkpoint.data_position import dataset_state
from kiln.engine.checkpoint.files import (
    LOOP,
    POSITION,
    PREFIX,
    RNG,
    STATE,
    _remove,
    is_complete,
    kept,
    latest_checkpoint,
    list_checkpoints,
)
from kiln.engine.checkpoint.hf_files import write_model_files, write_training_args
from kiln.engine.checkpoint.integrity import VERSION
from kiln.engine.checkpoint.lease import LeaseLost
from kiln.engine.checkpoint.loading import load_checkpoint
from kiln.engine.checkpoint.output_dir import is_writer
from kiln.engine.checkpoint.remote_run import RunUploads
from kiln.engine.checkpoint.restored import Restored
from kiln.engine.checkpoint.saved_config import CONFIG
from kiln.engine.checkpoint.signing import signing_key
from kiln.engine.checkpoint.write_errors import write_errno, write_failure
from kiln.engine.model.peft import checkpoint_io_for
from kiln.engine.seed import rng_state
from kiln.strategies.checkpoint_io import StagedWrite
from kiln.strategies.weights_files import tie_groups
from kiln.utils.errors import CheckpointError
from kiln.utils.host_copy import HostStaging

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.engine.callbacks.base import CallbackHandler
    from kiln.engine.hooks import Stateful
    from kiln.engine.run import Run
    from kiln.precision.base import Precision
    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)


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
        self._config_text: tuple[dict[str, Any], str] | None = None  # config.yaml's tree and text, last written
        self.signing_key = signing_key(config.save.signing_key_env)  # fails here, before training, when unset
        self.uploads = RunUploads(config, strategy, self.signing_key)  # to save.remote_dir (remote_run)

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
            staged = self._stage(io, tmp, writer)
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
        from_nodes = self.uploads.from_nodes(writer)
        if staged is not None:
            # every rank: a sharded format's ranks each wait for their own files (DCP's async_save)
            self.uploads.pending = (final, best) if from_nodes else None  # no collective on the background thread
            self._background.start(state.global_step, lambda: self._complete(staged, tmp, final, meta, best, writer))
            if writer and self.callbacks.reads_checkpoint_on_save():  # on_save must find the folder (artifacts, Ray)
                self._background.finish()
            return final
        lost = None
        if writer:
            try:
                self._published(final, best)
            except LeaseLost as err:  # raised on every rank where they meet, below
                lost = err
        if from_nodes:
            self.uploads.upload_from_nodes(final, best, writer)
        self.uploads.done(lost)  # the ranks' last barrier of the save
        return final

    def _stage(self, io: Any, tmp: str, writer: bool) -> StagedWrite | None:
        """The host copy of the model and optimizer files for a background write, or None to write them now."""
        cfg, run = self.config, self.run
        if not cfg.save.async_save:
            return None
        staged = io.stage(
            directory=tmp,
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
            "data_shards": self.strategy.data_shards,  # what decides the data order (a pp stage reads no batches of its own)
            "format": io.format,
            "resumable": not self.config.save.only_model,
        }
        if ties := tie_groups(self.run.model):  # `kiln convert` stores each tie once again (weights_files)
            meta["tied"] = ties
        return meta

    def _complete(
        self, staged: StagedWrite, tmp: str, final: str, meta: dict[str, Any], best: str | None, writer: bool
    ) -> None:
        """The background half of an asynchronous save: the staged files (this rank's), then, on the
        writer, exactly what a synchronous save does after them. The writer's staged write returns once
        every rank's files are durable (a sharded format's own collective says so: DCP's async_save)."""
        try:
            staged(tmp)
            if writer:
                self._publish(tmp, final, meta)
        except Exception as err:
            self._failed(err, tmp, final, writer)
            raise
        if writer:
            self._published(final, best)

    def _published(self, final: str, best: str | None) -> None:
        """The one place a complete checkpoint is announced, on the writer: local rotation, then, for a run
        with an object store (save.remote_dir), its upload (remote_run.RunUploads)."""
        self.rotate(best)
        self.uploads.published(final, best)

    def upload_outputs(self) -> None:
        """Every rank: upload the files at the top of output_dir (the exported model, trainer_state.json) to
        the run's store, from global rank 0 (a run lock lost there stops every rank); nothing for a run
        without one."""
        self.uploads.upload_outputs()

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
        end of fit and at a preemption (and at a step boundary: step_end). Without save.async_save there is
        nothing to wait for. A checkpoint that several nodes upload together (RunUploads.from_nodes) is
        uploaded here, once written: its collectives cannot run on the background thread."""
        if not self.config.save.async_save:
            return
        error = self._background.join()
        upload, self.uploads.pending = self.uploads.pending, None
        failure = None if error is None else (isinstance(error, LeaseLost), str(error))
        if self.strategy.world_size > 1:  # only the writers write in the background: tell every rank
            failures = [f for f in self.strategy.all_gather_object(failure) if f]
            failure = failures[0] if failures else None
        if error is not None:
            raise error
        if failure is not None:  # a run lock lost to another run stops every rank as LeaseLost, as on the writer
            raise (LeaseLost if failure[0] else CheckpointError)(failure[1])
        if upload is not None:
            self.uploads.upload_from_nodes(*upload, is_writer(self.config, self.strategy))

    def step_end(self) -> None:
        """Every rank, at each step boundary: a checkpoint that several nodes upload together (an
        asynchronous save with RunUploads.pending) is uploaded (wait) at the first boundary where every
        rank's background write has finished, rather than at the next save: its collectives cannot run on
        the background thread. One scalar min-reduce per step while such an upload waits; nothing else."""
        if self.uploads.pending is None:
            return
        written = torch.tensor(0.0 if self._background.running else 1.0, device=self.strategy.root_device)
        if self.strategy.reduce(written, "min").item() > 0:
            self.wait()

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
        with open(os.path.join(tmp, CONFIG), "w", encoding="utf-8") as fh:
            fh.write(self._config_yaml())
        # HF's files (kiln.engine.checkpoint.hf_files): from_pretrained(checkpoint) works, tools find their files
        write_model_files(tmp, run.model, self.callbacks.objects.get("processing_class"))
        write_training_args(tmp, self.config, self.training_args)

    def config_to_save(self) -> Any:
        """The run's config as config.yaml keeps it (a DictConfig of `saved_tree`)."""
        from omegaconf import OmegaConf

        return OmegaConf.create(self.saved_tree())

    def _config_yaml(self) -> str:
        """config.yaml's text (what `OmegaConf.save(config_to_save())` writes), made again only when the
        saved tree changed: building the DictConfig costs a save tenths of a second, on the step thread."""
        tree = self.saved_tree()
        if self._config_text is None or self._config_text[0] != tree:
            from omegaconf import OmegaConf

            self._config_text = (tree, OmegaConf.to_yaml(OmegaConf.create(tree)))
        return self._config_text[1]

    def saved_tree(self) -> dict[str, Any]:
        """The run's config as plain containers: `${oc.env:...}` values masked, and the live micro-batch
        size and accumulation (auto_find_batch_size may have changed them), which a resumed run adopts."""
        from kiln.config.redact import config_for_saving

        saved = config_for_saving(self.config)
        saved["data"]["per_device_train_batch_size"] = self.run.micro_batch_size
        saved["train"]["gradient_accumulation_steps"] = self.run.accumulation
        return saved

    def _publish(self, tmp: str, final: str, meta: dict[str, Any]) -> None:
        publish_folder(tmp, final, meta, self.signing_key)

    def _clear_debris(self, out: str) -> None:
        """Remove hidden leftovers of a run killed while saving or rotating (once per process)."""
        if not self._debris_cleared:
            clear_debris(out)
            self._debris_cleared = True

    def _loop_state(self) -> dict[str, Any]:
        """This rank's loop accumulators and iterable-dataset position."""
        loop = self.loop.state_dict() if self.loop is not None else None
        return {"loop": loop, "dataset": dataset_state(self.loader) if self.loader is not None else None}

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

    # -- load (kiln.engine.checkpoint.loading) ----------------------------------------------
    def load(self, path: str) -> Restored:
        """Load the weights, optimizer, schedule and precision state of `path` into the (already set-up)
        run; return the trainer state and what the loop applies later (see Restored)."""
        return load_checkpoint(self, path)
