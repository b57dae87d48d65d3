"""The expert axis `ep` of the mesh strategy: the experts of every MoE layer split over the ep ranks,
tokens sent to them and back by all-to-all (experts.py); everything else replicated (ep alone) or
sharded by FSDP2 (ep within dp_shard).

    strategy: {name: model_parallel, mesh: {ep: 2}}                 # 2 processes, the rest replicated
    strategy: {name: model_parallel, mesh: {dp_shard: 4, ep: 2}}    # 4 processes, everything FSDP
    strategy: {name: model_parallel, mesh: {dp_replicate: 2, ep: 2}}  # 4 processes, 2 replicas of ep 2

Alone:
The batch: every ep rank reads its own batches (ep is a data axis: `data_shards` = ep), routes its own
tokens, and its experts compute on the rows every rank sends them. The parameters: the experts'
weights are DTensors sharded on the expert dimension (each rank holds num_experts / ep of each layer);
every other parameter (attention, norms, router, shared experts, embeddings, head) is a plain tensor,
the same on every rank, whose gradient is averaged over the ranks at the window's end, as DDP's.

The loss follows kiln's global item-count rule as under DDP: `item_shards` = `grad_divisor` = ep, so
micro-batch i of rank r weighs n_i * ep / N (N: the window's items summed over the ranks), the
replicated gradients are averaged over ep and the experts' (which already hold every rank's tokens
through the all-to-all's backward) are divided by ep, which together give the gradient of the mean
loss over the global batch. A model that takes `num_items_in_batch` divides by N itself and adds its
router's auxiliary loss (`output_router_logits`, `router_aux_loss_coef`) on the rank's own tokens, so
the step's gradient holds the sum over ranks of each rank's auxiliary loss: HF's Trainer under DDP
counts it the same way (it multiplies the loss by the world size, and DDP averages).

Within dp_shard (torchtitan's `dp_shard_in_ep`, dims.py): ep's ranks are dp_shard's, so the D
processes are the data shards and FSDP2 shards every parameter that is not an expert over them, as
`{dp_shard: D}` alone does; the experts are split over ep (dp_shard rank r holds ep rank r % ep), and
each experts module is its own FSDP unit over the D / ep ranks holding the same experts
(`dp_shard_mod_ep`), its reduced gradient divided by D (`_apply_tp`). Gradient clipping takes the norm
across both meshes (clip.py).

Beside tp (`{ep: 2, tp: 2}`: ranks 0-1 one data shard, 2-3 the other; ep groups {0, 2} and {1, 3}):
as alone, with the model's own tensor-parallel plan (tp_plan.py, its entries for the experts left out:
ep splits those) applied over each data shard's tp ranks before the experts are split. The tp ranks
of a data shard route the same tokens, so each exchanges them with its own ep group, and their expert
shards stay equal. The gradients of everything that is not an expert, tp pieces included, are averaged
over ep (each tp rank its own pieces), the experts' divided by ep; clipping weighs each piece by the
ranks that hold it (clip.py).

Beside dp_replicate (`{dp_replicate: 2, ep: 2}`: replicas {0, 1} and {2, 3}, each one ep group;
dp_replicate groups {0, 2} and {1, 3}): as alone within each replica, every rank a data shard
(`data_shards` = `grad_divisor` = R x N). The replicated gradients are averaged over every rank; each
expert shard's gradient holds its replica's tokens (the all-to-all's backward), so it is summed over
dp_replicate (the ranks holding the same experts) and divided by R x N: HSDP with shards of one rank,
as pp beside dp_replicate. Clipping counts each expert shard once, though R ranks hold it.

Evaluation and prediction run every rank's batches through the same all-to-alls: kiln's evaluation
sampler gives every rank the same number of batches, so no rank leaves the collectives early, and
`generate()` (predict_with_generate) runs with transformers' `synced_gpus`, so no rank stops decoding
before the others have.

Checkpoints are the mesh strategy's DCP folder (the experts' DTensor shards with their global offsets),
which resumes on any other mesh and converts to one model. What it cannot run is refused at config
load, in one sentence each."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.strategies.base import StepResult
from kiln.strategies.interfaces import ReportsStepFigures
from kiln.strategies.mesh.axis_refusals import refuse, unsupported_settings
from kiln.strategies.mesh.strategy import MeshStrategy

if TYPE_CHECKING:
    from collections.abc import Iterator

log = logging.getLogger(__name__)


class ExpertParallelStrategy(MeshStrategy, ReportsStepFigures):
    """The mesh strategy with an `ep` axis; a preset supplies `read_settings` and `mesh_request`."""

    def _check_settings(self) -> None:
        check_expert_parallel(self.shape.ep, self.settings, self.config, self.precision.name)
        super()._check_settings()

    @property
    def ep_mesh(self) -> Any:
        return self.device_mesh["ep"]

    # -- set-up -----------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        from kiln.strategies.mesh.experts import check_experts
        from kiln.strategies.mesh.tp_plan import user_module

        self._found = check_experts(user_module(module), self.shape.ep)
        if self.device_mesh is None:
            self.setup_environment()  # the group's world decides the mesh
        if self.shape.fsdp:  # ep within dp_shard: the mesh strategy's FSDP, the experts split in `_apply_tp`
            return super().setup_module(module)
        from kiln.strategies.mesh.experts import shard_experts
        from kiln.strategies.mesh.loading import sync_module_states

        module = module.to(self.root_device)
        if self.settings.sync_module_states:
            sync_module_states(module)  # the replicated parameters must be equal on every rank
        split = ""
        if self.shape.tp > 1:  # the model's own plan over tp, its experts left to ep
            from kiln.strategies.mesh.tp_plan import parallelize_tp

            what, self._loss_parallel = parallelize_tp(
                user_module(module),
                self.device_mesh,
                self.settings,
                self.shape.tp,
                loaded_split=False,
                restyle=self.precision.tensor_parallel_style,
                leave=set(self._found),
            )
            split = f", {what} over tp {self.shape.tp}"
        self._shards = shard_experts(self._found, self.ep_mesh)
        self._count_group = self._dp_group  # the ranks whose tokens differ (None: every rank)
        experts = {id(p) for m in self._found.values() for p in m.parameters()}
        trained = [p for p in module.parameters() if p.requires_grad]
        self._replicated = [p for p in trained if id(p) not in experts]
        self._experts = [p for p in trained if id(p) in experts]
        log.info(
            "%s: %d MoE layer(s), %d of %d experts each on this rank (ep %d)%s; %d parameter(s) replicated over ep.",
            self.name,
            len(self._found),
            self._shards[0].local,
            self._shards[0].num_experts,
            self.shape.ep,
            split,
            len(self._replicated),
        )
        self._root = module
        return module

    def _apply_tp(self, user: nn.Module, loaded_split: bool) -> str:
        """Under ep within dp_shard, where the mesh strategy would split the model (after the weights
        are synced, before FSDP): the experts split over ep, then each experts module FSDP-sharded over
        the dp_shard ranks left (torchtitan's order). Each expert's gradient holds the tokens of its ep
        group (the all-to-all's backward); FSDP sums it over dp_shard_mod_ep, and dividing by all of
        dp_shard (not dp_shard_mod_ep) gives the mean over every rank, as the other parameters get."""
        from kiln.strategies.mesh.dims import DP_SHARD_MOD_EP
        from kiln.strategies.mesh.experts import shard_experts
        from kiln.strategies.mesh.fsdp import apply_fsdp

        s, mesh = self.settings, self.device_mesh
        self._shards = shard_experts(self._found, self.ep_mesh)
        self._count_group = mesh["dp_shard"].get_group()
        for experts in self._found.values():
            apply_fsdp(
                experts,
                [],
                mesh[DP_SHARD_MOD_EP],
                reshard=s.reshard,
                offload=False,
                pin_memory=False,
                mp_policy=self._mp_policy,
                forward_prefetch=False,
            )
            experts.set_gradient_divide_factor(float(self.shape.dp_shard))
            # a divisor other than the group's size is NCCL's PREMUL_SUM, which gloo has not: sum, then divide.
            # Only where the group has more than one rank: on one rank (dp_shard = ep) FSDP2's sum-then-divide
            # path missed parity with `single` by 4e-4 on the experts (the parity test), its default does not.
            experts.set_force_sum_reduction_for_comms(self.shape.dp_shard > self.shape.ep)
        return (
            f"{len(self._found)} MoE layer(s), {self._shards[0].local} of {self._shards[0].num_experts} experts each "
            f"on this rank (ep {self.shape.ep}), FSDP over the {self.shape.dp_shard // self.shape.ep} rank(s) of "
            f"{DP_SHARD_MOD_EP}"
        )

    @contextlib.contextmanager
    def eval_cast_context(self, module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
        """Around one evaluation (or prediction): `generate()` (predict_with_generate) keeps every rank
        stepping until every rank's sequences have ended (transformers' `synced_gpus`, which it turns
        on by itself only for ZeRO-3 and the FSDP models it recognises): each decoding step's forward
        runs the experts' all-to-alls, which a rank that stopped early would leave unmatched. A
        `synced_gpus` given in the generation kwargs still wins."""
        generate = getattr(module, "generate", None)
        with super().eval_cast_context(module, dtype):
            if generate is None:
                yield
                return
            model: Any = module
            model.generate = functools.partial(generate, synced_gpus=True)  # shadows the class's method
            try:
                yield
            finally:
                del model.generate

    # -- step -------------------------------------------------------------------------------
    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        if not self.shape.fsdp:  # within dp_shard, FSDP reduced every gradient
            self.average_gradients()
        return super().optimizer_step(model, optimizer, max_grad_norm)

    def average_gradients(self) -> None:
        """With ep's own ranks, the replicated parameters' gradients averaged over the data ranks (ep,
        times dp_replicate beside it: one all-reduce of them flattened); the experts' summed over
        dp_replicate (the ranks holding the same experts, when it is used) and divided by the data
        ranks. A gradient that is missing (no token reached this rank's experts in the whole window)
        counts as zeros, so every rank steps the same parameters, as one process steps its whole
        expert tensor."""
        dp = self.shape.dp
        for p in self._replicated + self._experts:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():  # under tp, the split layers' local pieces: each tp rank all-reduces its own
            # the ranks whose data differ: ep's at this tp position, dp_replicate's too (None: every rank)
            _average([_local(p.grad) for p in self._replicated], self._dp_group, dp)
            replicas = self.device_mesh["dp_replicate"].get_group() if self.shape.dp_replicate > 1 else None
            _average([_local(p.grad) for p in self._experts], replicas, dp, reduce=replicas is not None)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The global 2-norm: the replicated gradients once, every rank's expert shards (clip.py's
        weighting of plain and sharded gradients), then every gradient scaled alike."""
        from kiln.strategies.mesh.clip import clip_global_norm

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_global_norm(params, max_norm, tp=True, world=self.world_size, device=self.root_device)

    # -- logging ----------------------------------------------------------------------------
    def step_figures(self, steps: int) -> dict[str, float]:
        """Tokens per expert per step since the last log, over every MoE layer and rank (the load
        balance): the mean, the least and the most loaded expert, and the largest ratio of the most
        loaded expert to its layer's mean."""
        from kiln.strategies.mesh.experts import take_counts

        counts = take_counts(self._shards, self._count_group).double() / max(steps, 1)  # [layers, experts]
        mean = counts.mean(1)
        figures = torch.stack(
            [counts.mean(), counts.min(), counts.max(), (counts.max(1).values / mean.clamp(min=1e-9)).max()]
        ).tolist()  # the one host read
        names = ("mean", "min", "max", "imbalance")
        return {f"moe/tokens_per_expert_{name}": value for name, value in zip(names, figures)}

    def teardown(self) -> None:
        self._found, self._shards, self._replicated, self._experts = {}, [], [], []
        super().teardown()


def _average(grads: list[torch.Tensor], group: Any, divisor: int, *, reduce: bool = True) -> None:
    """Sum `grads` over `group` (one all-reduce of them flattened; None: every rank), unless not
    `reduce`, and divide them by `divisor`, in place."""
    import torch.distributed as dist

    if not grads:
        return
    if not reduce:
        torch._foreach_div_(grads, divisor)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= divisor
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def _local(t: Any) -> Any:
    """A DTensor's local piece (the storage this rank holds), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def check_expert_parallel(ep: int, s: Any, config: Any, precision: str) -> None:
    """What this first expert axis cannot run, refused before any process group starts."""
    settings = unsupported_settings(s, config)
    settings["sequence_parallel"] = s.sequence_parallel
    settings["loss_parallel"] = s.loss_parallel
    if precision in ("fp16", "fp16-true"):
        settings[f"precision {precision}"] = True
    refuse("ep", ep, settings)
