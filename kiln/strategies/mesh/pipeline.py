"""The pipeline axis `pp` of the mesh strategy: a Transformers decoder cut into stages
(pipeline_split.py), run by torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B,
and the zero-bubble ZB1P and ZBV).

    strategy: {name: model_parallel, mesh: {pp: 2}, pipeline: {schedule: 1f1b, split: auto}}

The accumulation window is the pipeline's micro-batches: the strategy owns the window
(`OwnsMicroBatchWindow.run_window`), so the engine's loop has no pipeline branch. The window's
micro-batches are padded to one shape (rows whose labels are all -100, positions after each sequence's
end -- which a causal decoder never attends to from the positions before), stacked, and handed to the
schedule built for that shape (pipeline_schedule.py), which cuts them apart again; the last stage
computes micro-batch i's loss with the model's own `loss_function` on its logits and weighs it with
kiln's item-count rule (`weights`), exactly what `Trainer.training_step` does for it on one process. The losses go from the last stage to every stage
at the optimizer step (in the gradient norm's collective where pp is 2 and clipping is on, else by a
broadcast), so every rank logs them. Gradient clipping takes the norm over every stage's gradients.

Every stage reads the same batches, so sums and means of what the loop counts span the ranks of one
stage (its dp_shard ranks: one data shard each), and gathers keep one entry per data shard.

With dp_shard beside pp (`mesh: {pp: 2, dp_shard: 2}`, 4 processes: ranks 0-1 hold stage 0, 2-3
stage 1), each stage is sharded by FSDP2 over its dp_shard ranks, as torchtitan does: every decoder
layer the stage holds is a unit, and the stage's forward (`StageForward`, the module `PipelineStage`
runs: embeddings, norm, head) the root unit. Units keep their parameters gathered from a
micro-batch's forward to its backward (reshard_after_forward false: the schedule runs each unit once
per micro-batch, both ways), and torch's stage holds FSDP's gradient reduction back until the
window's last backward, where it reduce-scatters once (`PipelineStage.backward_maybe_with_nosync`),
dividing by dp_shard, the strategy's `grad_divisor`, which kiln's item-count weights undo. Gradient
clipping takes the norm over the shards and the stages in one all-gather over every rank (clip.py's
`clip_over_sharded_stages`; the losses ride in it where pp is 2). The pruned model keeps the full model's parameter
names (pipeline_split.py), so the mesh strategy's DCP checkpoints hold one model, which resumes on one
process or on any other mesh; exporting gathers every stage's weights to rank 0.

A rank may hold several stages (the interleaved and zero-bubble schedules, `stages_per_rank`), placed
as torch's schedules place them (`stage_owners`). Evaluation and prediction run the whole model's
forward stage to stage (pipeline_forward.py).

With dp_replicate beside pp instead (`mesh: {pp: 2, dp_replicate: 2}`), the layout is the same and each
stage is FSDP2's HSDP over its dp_replicate ranks with shards of one rank (the mesh strategy's
`dp_mesh`): the replicas hold their stage whole and all-reduce its gradients once per window.

With tp beside pp (`mesh: {pp: 2, tp: 2}`: ranks 0-1 hold stage 0, 2-3 stage 1, one data shard), each
rank's pruned model is split by kiln's tensor-parallel plan (tp_plan.py, the model's own plan) over its
stage's tp ranks, after pruning, so the plan's patterns find the layers the stage holds (and skip the
rest); the stages' views share those layers. The stages' activations and the head's logits are whole
tensors (rowwise layers sum their outputs, the head gathers its columns), which each tp rank sends over
its own pp group. Clipping there weighs each gradient piece by the stage's ranks that hold it (clip.py),
since the split layers' DTensors and the norms' plain tensors cannot share one DTensor norm.

pp runs alone or with one of dp_shard, dp_replicate or tp (not cp, nor two of them): what it cannot run
is refused at config load (pipeline_settings.py)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kiln.strategies.base import StepResult
from kiln.strategies.interfaces import LossWeights, OwnsMicroBatchWindow
from kiln.strategies.mesh.pipeline_schedule import WindowSchedule, stack_window
from kiln.strategies.mesh.pipeline_settings import PipelineSettings, check_pipeline, read_pipeline
from kiln.strategies.mesh.strategy import MeshStrategy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class PipelineStrategy(MeshStrategy, OwnsMicroBatchWindow):
    """The mesh strategy with a `pp` axis; a preset supplies `read_settings` and `mesh_request`."""

    loss_source: ClassVar[str] = (
        "the model's loss_function, which the last stage applies to the logits (assign model.loss_function "
        "to change it)"
    )
    pipeline: PipelineSettings
    #: the mesh's pp group, looked up once in `setup_environment` (None before it and after teardown)
    _pp_group: Any = None
    #: the last window's losses until the optimizer step sends them to every stage
    _unsent: torch.Tensor | None = None
    #: under pp x dp_shard, the optimizer `clip_gradients` last saw, its parameters, and every rank's
    #: parameter count (None: `clip_over_stages`)
    _clip_counts: tuple[Any, list[Any], list[int] | None] = (None, [], None)
    #: whether this rank holds the first stage, and the last (`setup_module`)
    _ends: tuple[bool, bool] = (True, True)
    #: the schedule for the running window's shape (a WindowSchedule, pipeline_schedule.py; None before
    #: `setup_module` and after teardown)
    _schedule_for: Any = None

    def _check_settings(self) -> None:
        # pp's own refusals first (as ep's): the mesh's checks would name a setting pp leaves out in a sentence
        # about another mesh (offload: "tensor parallel alone")
        self.pipeline = read_pipeline(self.option("pipeline"))
        check_pipeline(self.pipeline, self.shape, self.settings, self.config, self.precision.name)
        super()._check_settings()

    # -- topology: every stage reads the same batches ------------------------------------------
    @property
    def pp_rank(self) -> int:
        return self.shape.stage(self.global_rank)

    def _global_rank_of(self, pp_rank: int) -> int:
        """The global rank at `pp_rank`'s place in the pipeline and this rank's place in a stage."""
        return pp_rank * self.shape.stage_ranks + self.global_rank % self.shape.stage_ranks

    @contextlib.contextmanager
    def eval_cast_context(self, module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
        """Around one evaluation (or prediction), the model's forward is the whole model's, run stage
        to stage (pipeline_forward.py): every rank gets the logits and the loss single would."""
        from kiln.strategies.mesh.pipeline_forward import ChainedForward

        root: Any = self._root
        with super().eval_cast_context(module, dtype):
            root.forward = ChainedForward(self, root)  # an instance attribute shadows the class's forward
            try:
                yield
            finally:
                del root.forward
                if self.shape.dp > 1:  # forwards without backwards leave the units gathered (reshard_after_forward)
                    from kiln.strategies.mesh.fsdp import reshard_all

                    for forward in self.stage_forwards:
                        reshard_all(forward)

    def setup_environment(self) -> None:
        super().setup_environment()
        # a sub-mesh's group, kept: slicing a DeviceMesh is ~0.3 ms of Python, and every step used it twice
        self._pp_group = self.device_mesh["pp"].get_group()
        if self.shape.dp > 1:  # what `reduce` sums over: the ranks of this stage, one data shard each
            self._dp_group = self.device_mesh["dp_replicate" if self.shape.dp_replicate > 1 else "dp_shard"].get_group()

    # -- set-up -----------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage

        from kiln.strategies.mesh.loading import sync_module_states
        from kiln.strategies.mesh.pipeline_split import (
            StageForward,
            decoder_of,
            keep_stage,
            stage_decoder,
            stage_owners,
            stage_ranges,
        )

        decoder = decoder_of(module)
        if self.device_mesh is None:
            self.setup_environment()
        p, pp, rank = self.pipeline, self.shape.pp, self.pp_rank
        count = p.stages(pp)
        module = module.to(self.root_device)
        if self.settings.sync_module_states:
            sync_module_states(module)  # every stage cut from rank 0's weights, whatever seed built them
        ranges = stage_ranges(module, decoder, count, p.split, self.device_mesh)
        self._owner = stage_owners(pp, count, p.style)
        #: the global rank that holds the last stage beside this one (it computes the losses)
        self._loss_rank = self._global_rank_of(self._owner[-1])
        mine = [s for s in range(count) if self._owner[s] == rank]
        layers = list(decoder.layers)
        self.stage_forwards = [
            StageForward(
                stage_decoder(decoder, [layers[i] for i in ranges[s]], first=s == 0, last=s == count - 1),
                getattr(module, "lm_head", None),
                self.precision,
                first=s == 0,
                last=s == count - 1,
            )
            for s in mine
        ]
        keep_stage(module, decoder, [i for s in mine for i in ranges[s]], first=0 in mine, last=count - 1 in mine)
        split = f", {self._apply_tp(module, loaded_split=False)} over tp {self.shape.tp}" if self.shape.tp > 1 else ""
        if self.shape.dp > 1:
            self._shard_stages([ranges[s] for s in mine], layers)
        self._stages = [
            PipelineStage(forward, s, count, self.root_device, group=self.pp_group)
            for forward, s in zip(self.stage_forwards, mine)
        ]
        #: whether this rank holds the first stage, and the last
        self._ends = (0 in mine, count - 1 in mine)
        self._schedule_for = WindowSchedule(p.schedule, self._stages, pp, self._loss)
        #: the running window's labels, loss weights, and the model's loss_function and vocab_size, read once a window
        self._window: tuple[list[torch.Tensor], LossWeights | None, Any, int] = ([], None, None, 0)
        self._model = module
        log.info(
            "%s: rank %d of the pipeline holds stage(s) %s (decoder layers %s)%s%s%s (schedule %s).",
            self.name,
            rank,
            ", ".join(map(str, mine)),
            ", ".join(f"{ranges[s].start}-{ranges[s].stop - 1}" for s in mine),
            ", the embeddings" if 0 in mine else "",
            ", the final norm and lm_head" if count - 1 in mine else "",
            split,
            p.schedule,
        )
        self._root = module
        return module

    def _shard_stages(self, held: list[range], layers: list[nn.Module]) -> None:
        """FSDP2 over this stage's data-parallel ranks (dp_shard; dp_replicate as HSDP, the mesh
        strategy's `dp_mesh`): each decoder layer a unit, then each stage's forward (the module torch's
        stage runs and syncs, with the embeddings, norm and head) a root unit."""
        from kiln.strategies.mesh.dims import dp_mesh
        from kiln.strategies.mesh.fsdp import apply_fsdp

        for forward, indices in zip(self.stage_forwards, held):
            apply_fsdp(
                forward,
                [layers[i] for i in indices],
                dp_mesh(self.device_mesh, self.shape),
                reshard=False,  # gathered from a micro-batch's forward to its backward, as torchtitan under pp
                offload=False,
                pin_memory=False,
                mp_policy=None,  # the stage runs in the precision's autocast (StageForward)
                forward_prefetch=self.settings.forward_prefetch,
                # the schedule and ChainedForward call each stage's forward itself, never its decoder view
                # or head alone: hooks gathering the root around such calls would only cost 4-6 calls a
                # micro-batch and stage
                direct_calls=False,
            )

    # -- the window -------------------------------------------------------------------------
    def run_window(self, model: nn.Module, window: list[Any], weights: LossWeights | None) -> list[torch.Tensor]:

        ids, mask, labels = stack_window(window)
        n = len(window)
        schedule = self._schedule_for((n, tuple(ids.shape), mask is None))
        first, last = self._ends
        if last:  # `_loss` runs once a micro-batch: what it reads of the model is read here, once a window
            full: Any = self._model
            self._window = (labels, weights, full.loss_function, full.config.vocab_size)
        losses: list[torch.Tensor] = []
        schedule.step(
            *((ids,) if first else ()),
            target=torch.arange(n, device=ids.device) if last else None,  # micro-batch i's index, for `_loss`
            losses=losses if last else None,
            return_outputs=False,
            **({"attention_mask": mask} if mask is not None else {}),
        )
        self._window = ([], None, None, 0)
        # -0.0 where this stage has no losses: x + -0.0 is x for every x, so a sum over the stages gives them
        out = (
            torch.stack([loss.detach().float() for loss in losses])
            if last
            else torch.full((n,), -0.0, device=ids.device)
        )
        self._unsent = out  # filled in on every stage by `optimizer_step`, before anything reads them
        return list(out.unbind())

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Micro-batch `target[0]`'s loss, weighted as `Trainer.training_step` weighs it (the schedule
        also calls this once, on micro-batch 0, when it measures a new stage: that loss is dropped)."""
        labels, weights, loss_function, vocab_size = self._window
        i = int(target[0])
        divides = weights is not None and weights.model_divides
        loss = loss_function(
            logits=logits,
            labels=labels[i],
            vocab_size=vocab_size,
            num_items_in_batch=weights.total if divides else None,  # type: ignore[union-attr]
        )
        weight = weights.weight(i) if weights is not None else None
        return loss if weight is None else loss * weight

    # -- step -------------------------------------------------------------------------------
    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        """The mesh strategy's step; first the window's losses go from the last stage to every stage
        (they stay tensors until a log step reads them). Where pp is 2 and the gradients are clipped
        without tp, they travel in the norm's all-reduce instead (`clip_gradients`): a sum of two values
        is the same in either order, so the norm is the one a lone all-reduce gives, and one collective
        a step is saved."""
        if not (max_grad_norm and self._folds_losses):
            self._send_losses()
        return super().optimizer_step(model, optimizer, max_grad_norm)

    @property
    def _folds_losses(self) -> bool:
        return self.shape.pp == 2 and self.shape.tp == 1

    def _send_losses(self) -> None:
        out, self._unsent = self._unsent, None
        if out is not None:
            import torch.distributed as dist

            dist.broadcast(out, src=self._loss_rank, group=self._pp_group)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The 2-norm over every stage's gradients (each parameter lives on one stage; under dp_shard
        its shards' norm is DTensor's over the stage's ranks; under tp, where the split layers' DTensors
        and the whole norms' tensors cannot be mixed in one norm, clip.py's sum over every rank, each
        piece weighted by how many of the stage's ranks hold it), then each stage's gradients scaled by
        the same factor. Under pp x dp_shard alone, one all-gather over every rank in place of two
        all-reduces (`clip_over_sharded_stages`)."""
        from kiln.strategies.mesh.clip import (
            clip_across_meshes,
            clip_over_sharded_stages,
            clip_over_stages,
            sharded_stage_counts,
        )

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.shape.tp > 1:
            grads = [p.grad for p in params if p.grad is not None]
            return clip_across_meshes(grads, max_norm, self.shape.stage_ranks, self.world_size, self.root_device)
        riders = None
        if self._folds_losses:  # the window's losses ride in the norm's all-reduce
            riders, self._unsent = self._unsent, None
        if self.shape.dp_shard > 1 and self.shape.dp_replicate == 1:
            if self._clip_counts[0] is not optimizer:  # once an optimizer, on every rank alike
                every = [p for group in optimizer.param_groups for p in group["params"]]
                self._clip_counts = (optimizer, every, sharded_stage_counts(every, self.root_device))
            _, every, counts = self._clip_counts
            if counts is not None:
                return clip_over_sharded_stages(
                    every, max_norm, counts, self.shape.stage_ranks, self.global_rank, self.root_device, riders
                )
        return clip_over_stages(params, max_norm, self._pp_group, self.root_device, riders)

    # -- collectives: the stages hold copies of what the loop counts ---------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """sum and mean over the ranks of this stage (its data shards; pp alone: this rank's value);
        max and min over every rank."""
        if op in ("sum", "mean"):
            return self._reduce_over_data(tensor, op)
        return super().reduce(tensor, op)

    def reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        """The sum over this stage's data shards started now on the ranks that hold the last stage (the
        window's item count weighs its losses there); elsewhere it runs if and when it is read, the
        same point on every rank of the stage, and a window that never reads it makes no collective."""
        if op == "sum":
            if not self._ends[1]:
                return lambda: self._reduce_over_data(tensor, "sum")
            return self._sum_over_data_async(tensor)
        done = self.reduce(tensor, op)
        return lambda: done

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """One entry per data shard: those of the first stage's (MeshCollectives keeps one per tp group)."""
        return super().all_gather(tensor)[: self.shape.dp]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return super().all_gather_object(obj)[: self.shape.dp]

    # -- checkpoints and export -------------------------------------------------------------
    @property
    def pp_group(self) -> Any:
        """The process group of this rank's pipeline (the mesh's `pp` axis)."""
        return self._pp_group

    def checkpoint_io(self) -> Any:
        from kiln.strategies.mesh.pipeline_checkpoint import PipelineCheckpointIO

        return PipelineCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Every stage's weights, under the full model's names, on rank 0 (the others get {}), or on
        every rank with save.on_each_node."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        own = {  # a stage's shards gathered (a collective over its dp_shard ranks), which then hold copies
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in self.unwrap(module).state_dict().items()
        }
        every_rank = bool(self.config.save.on_each_node) if self.config is not None else False
        parts: list[Any] = [None] * self.world_size
        if every_rank:
            dist.all_gather_object(parts, own)
        else:
            dist.gather_object(own, parts if self.is_global_zero else None, dst=0)
            if not self.is_global_zero:
                return {}
        return {k: v for part in parts for k, v in part.items()}

    def teardown(self) -> None:
        self._schedule_for, self._pp_group, self._unsent, self._clip_counts = None, None, None, (None, [], None)
        self._stages, self.stage_forwards = [], []
        super().teardown()
