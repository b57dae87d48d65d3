"""The expert axis `ep` of the mesh strategy: the experts of every MoE layer split over the ep ranks,
tokens sent to them and back by all-to-all (experts.py), everything else replicated.

    strategy: {name: model_parallel, mesh: {ep: 2}}

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

Checkpoints are the mesh strategy's DCP folder (the experts' DTensor shards with their global offsets),
which resumes on any other mesh and converts to one model. It runs alone so far; what it cannot run
is refused at config load, in one sentence each."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kiln.strategies.base import StepResult
from kiln.strategies.interfaces import ReportsStepFigures
from kiln.strategies.mesh.axis_refusals import refuse, unsupported_settings
from kiln.strategies.mesh.strategy import MeshStrategy
from kiln.utils.errors import KilnError

log = logging.getLogger(__name__)


class ExpertParallelStrategy(MeshStrategy, ReportsStepFigures):
    """The mesh strategy with an `ep` axis; a preset supplies `read_settings` and `mesh_request`."""

    def _check_settings(self) -> None:
        check_expert_parallel(self.shape.ep, self.settings, self.config, self.precision.name)
        super()._check_settings()

    @property
    def ep_mesh(self) -> Any:
        return self.device_mesh["ep"]

    def eval_cast_context(self, module: nn.Module, dtype: torch.dtype | None) -> Any:
        """Evaluation would run every rank's experts on data sharded by another rule (and stop the
        all-to-alls where one rank has a batch fewer), so evaluate and predict are refused (config load
        refuses evaluation during training; this catches `trainer.evaluate()` called by hand)."""
        raise KilnError(
            "evaluate and predict do not run under the expert axis yet (each rank holds some of the experts); "
            "convert a checkpoint with `kiln convert` and evaluate or predict it on one process."
        )

    # -- set-up -----------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        from kiln.strategies.mesh.experts import check_experts, shard_experts
        from kiln.strategies.mesh.loading import sync_module_states
        from kiln.strategies.mesh.tp_plan import user_module

        found = check_experts(user_module(module), self.shape.ep)
        if self.device_mesh is None:
            self.setup_environment()
        module = module.to(self.root_device)
        if self.settings.sync_module_states:
            sync_module_states(module)  # the replicated parameters must be equal on every rank
        self._shards = shard_experts(found, self.ep_mesh)
        self._replicated = [p for p in module.parameters() if p.requires_grad and not _is_dtensor(p)]
        self._experts = [p for p in module.parameters() if p.requires_grad and _is_dtensor(p)]
        log.info(
            "%s: %d MoE layer(s), %d of %d experts each on this rank (ep %d); %d replicated parameter(s).",
            self.name,
            len(found),
            self._shards[0].local,
            self._shards[0].num_experts,
            self.shape.ep,
            len(self._replicated),
        )
        self._root = module
        return module

    # -- step -------------------------------------------------------------------------------
    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
    ) -> StepResult:
        self.average_gradients()
        return super().optimizer_step(model, optimizer, max_grad_norm)

    def average_gradients(self) -> None:
        """The replicated parameters' gradients averaged over the ep ranks (one all-reduce of them
        flattened); the experts' divided by ep. A gradient that is missing (no token reached this
        rank's experts in the whole window) counts as zeros, so every rank steps the same parameters,
        as one process steps its whole expert tensor."""
        import torch.distributed as dist

        ep = self.shape.ep
        for p in self._replicated + self._experts:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            grads = [p.grad for p in self._replicated]
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
                dist.all_reduce(flat, group=self.ep_mesh.get_group())
                flat /= ep
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):  # type: ignore[union-attr]
                    g.copy_(part.view_as(g))  # type: ignore[union-attr]
            for p in self._experts:
                p.grad.div_(ep)  # type: ignore[union-attr]

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

        counts = take_counts(self._shards).double() / max(steps, 1)  # [layers, experts]
        mean = counts.mean(1)
        figures = torch.stack(
            [counts.mean(), counts.min(), counts.max(), (counts.max(1).values / mean.clamp(min=1e-9)).max()]
        ).tolist()  # the one host read
        names = ("mean", "min", "max", "imbalance")
        return {f"moe/tokens_per_expert_{name}": value for name, value in zip(names, figures)}

    def teardown(self) -> None:
        self._shards, self._replicated, self._experts = [], [], []
        super().teardown()


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def check_expert_parallel(ep: int, s: Any, config: Any, precision: str) -> None:
    """What this first expert axis cannot run, refused before any process group starts."""
    settings = unsupported_settings(s, config)
    if config is not None:
        settings["eval.strategy (evaluation runs every rank's experts)"] = str(config.eval.strategy) != "no"
    if precision in ("fp16", "fp16-true"):
        settings[f"precision {precision}"] = True
    refuse("ep", ep, settings)
