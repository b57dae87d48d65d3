"""Expert parallelism for the MoE layers of Transformers models: each rank of the `ep` axis holds
num_experts / ep experts of every MoE layer, and the tokens go to the experts that hold them and back
with two all-to-alls per layer (torchtitan's ExpertParallel, for transformers' own modules).

Transformers (>= 5) keeps a layer's experts in one module with fused 3-D weights (`MixtralExperts`,
`Qwen3MoeExperts`, `OlmoeExperts`, `DeepseekV3Experts`, ...: `gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I], made by `use_experts_implementation`), called as `experts(hidden [T, H], top_k_index
[T, k], top_k_weights [T, k])` after the layer's router. `shard_experts` makes both weights DTensors
sharded on the expert dimension over the ep mesh (`Shard(0)`: rank r holds experts r*E/ep ...
(r+1)*E/ep - 1, and DCP saves and reshards them as any DTensor) and gives the module the forward
below, which:

1. sorts this rank's (token, expert) pairs by expert and counts them per expert;
2. exchanges the counts (`all_to_all_single`, E integers: each rank learns how many rows each other
   rank sends to each of its experts) -- one host read per layer, for the split sizes;
3. sends each pair's hidden state to the expert's rank (`all_to_all_single` with split sizes, which
   gloo runs on the CPU and NCCL on GPUs), runs each local expert on its rows (transformers' eager
   math: `linear`, the module's `_apply_gate`, `linear`), and sends the rows back the same way;
4. weights each pair's output by its routing weight and sums a token's k pairs, as the experts'
   own forward does.

Both all-to-alls are differentiable (their backward is the reverse all-to-all), so each expert's
gradient holds every rank's tokens. The router, the shared experts and every other parameter run on
the rank's own tokens as they always do; the router's logits, and with them the model's auxiliary
load-balancing loss, are the rank's own (as under HF's Trainer with DDP).

Tokens per expert (step 1's counts) are added up on the device while training and read only when the
strategy logs (`take_counts`)."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.utils.errors import ConfigError

_WEIGHTS = ("gate_up_proj", "down_proj")
#: transformers' flags (use_experts_implementation) of the layout this forward runs -> the value it needs
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "has_post_expert_norm": False}


def expert_modules(model: nn.Module) -> dict[str, Any]:
    """name -> the experts module of every MoE layer (transformers' fused 3-D layout)."""
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "num_experts") and all(isinstance(getattr(module, w, None), nn.Parameter) for w in _WEIGHTS)
    }


def check_experts(model: nn.Module, ep: int) -> dict[str, Any]:
    """The model's experts modules, each one that ep cannot shard refused in one sentence."""
    found = expert_modules(model)
    if not found:
        raise ConfigError(
            f"strategy.mesh.ep is {ep}, but {type(model).__name__} has no experts module with fused 3-D expert "
            "weights (gate_up_proj, down_proj: transformers' Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 layout); "
            "drop ep for a dense model."
        )
    for name, module in found.items():
        wrong = [
            f"{flag}={getattr(module, flag)}" for flag, want in _LAYOUT.items() if getattr(module, flag, want) != want
        ]
        if wrong:
            raise ConfigError(
                f"{name} ({type(module).__name__}) stores its experts with {', '.join(wrong)}, which kiln's "
                "expert parallelism does not run yet (it runs gated experts without biases, stored "
                "[experts, out, in]); drop strategy.mesh.ep for this model."
            )
        if module.num_experts % ep:
            raise ConfigError(
                f"{name} has {module.num_experts} experts, which do not split evenly over ep {ep}; choose an "
                f"ep that divides {module.num_experts}."
            )
    return found


@dataclass
class ExpertShard:
    """What one experts module needs under ep: the group, which experts are this rank's, and the
    tokens routed to each expert since the last read (on the device)."""

    group: Any
    ep: int
    rank: int
    num_experts: int
    counts: torch.Tensor = field(repr=False)

    @property
    def local(self) -> int:
        return self.num_experts // self.ep


def shard_experts(modules: dict[str, Any], ep_mesh: Any) -> list[ExpertShard]:
    """Split each module's expert weights over `ep_mesh` (a 1-D DeviceMesh) and give it the
    expert-parallel forward; every rank must hold the same full weights before (the strategy syncs)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    shards = []
    for module in modules.values():
        for name in _WEIGHTS:
            weight = getattr(module, name)
            sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        counts = torch.zeros(module.num_experts, dtype=torch.long, device=module.gate_up_proj.device)
        shard = ExpertShard(ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank(), module.num_experts, counts)
        module._kiln_ep = shard
        module.forward = types.MethodType(_ep_forward, module)  # the instance's: its class's stays as it is
        shards.append(shard)
    return shards


def take_counts(shards: list[ExpertShard], group: Any) -> torch.Tensor:
    """[layers, experts] tokens routed to each expert since the last call, summed over `group` (the
    ranks whose tokens differ; a collective: every rank of it calls it), and each counter reset."""
    import torch.distributed as dist

    counts = torch.stack([s.counts for s in shards])
    dist.all_reduce(counts, group=group)
    for s in shards:
        s.counts.zero_()
    return counts


def _ep_forward(
    self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward under ep (see the module docstring)."""
    shard: ExpertShard = self._kiln_ep
    tokens, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)  # pairs grouped by expert, a token's pairs in order
    sent_counts = torch.bincount(ids, minlength=shard.num_experts)
    if self.training:
        shard.counts += sent_counts
    got_counts = torch.empty_like(sent_counts)  # [source rank, my expert] rows each rank sends me
    torch.distributed.all_to_all_single(got_counts, sent_counts, group=shard.group)
    sent = sent_counts.view(shard.ep, shard.local).sum(1).tolist()  # the one host read of the layer
    got_per_expert = got_counts.view(shard.ep, shard.local)
    got_total = got_per_expert.sum(1).tolist()
    rows = _AllToAll.apply(hidden[order // k], got_total, sent, shard.group)
    out = _run_local_experts(self, rows, got_per_expert)
    back = _AllToAll.apply(out, sent, got_total, shard.group)
    pairs = torch.empty_like(back)
    pairs[order] = back  # back in (token, k) order
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)
    return weighted.sum(1).to(hidden.dtype)


def _run_local_experts(self: Any, rows: torch.Tensor, got_per_expert: torch.Tensor) -> torch.Tensor:
    """Each local expert on its rows: `rows` come grouped by source rank, then by expert, so they are
    regrouped by expert first and put back after."""
    shard: ExpertShard = self._kiln_ep
    local_ids = torch.arange(shard.local, device=rows.device).repeat(shard.ep)
    expert_of_row = torch.repeat_interleave(local_ids, got_per_expert.reshape(-1))
    order = torch.argsort(expert_of_row, stable=True)
    grouped = rows[order]
    gate_up, down = local_weight(self.gate_up_proj), local_weight(self.down_proj)
    sizes = got_per_expert.sum(0).tolist()
    outs = []
    for e, part in enumerate(grouped.split(sizes)):
        # an expert without rows runs too: its gradient is then zeros, not missing, so FSDP reduces
        # the same parameters on every rank
        h = self._apply_gate(nn.functional.linear(part, gate_up[e]))
        outs.append(nn.functional.linear(h, down[e]))
    out = torch.cat(outs)
    result = torch.empty_like(out)
    result[order] = out
    return result


def local_weight(weight: Any) -> torch.Tensor:
    """This rank's piece of an expert weight (a DTensor), differentiable: DTensor's own `to_local`,
    without the cost its backward pays to rebuild the gradient's sharding spec. The gradient has the
    weight's own spec (same mesh, placements, global shape and stride), so it is copied, not
    recomputed; a weight whose spec that shortcut cannot stand for (a Partial placement, or a local
    piece that is not contiguous) takes `to_local`. The values are the same either way."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return weight
    if weight._local_tensor.is_contiguous() and all(p.is_shard() or p.is_replicate() for p in weight.placements):
        return _ToLocal.apply(weight)
    return weight.to_local()


class _ToLocal(torch.autograd.Function):
    """`DTensor.to_local` whose backward wraps the (contiguous) gradient in a copy of the weight's spec."""

    @staticmethod
    def forward(ctx: Any, weight: Any) -> torch.Tensor:
        ctx.spec = weight._spec
        local = weight._local_tensor
        return local.view_as(local)  # a fresh tensor object: autograd writes its metadata into it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        import copy

        from torch.distributed.tensor import DTensor

        return DTensor(grad.contiguous(), copy.copy(ctx.spec), requires_grad=grad.requires_grad)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with split sizes; its backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None
