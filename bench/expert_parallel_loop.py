"""The ep row of bench/model_parallel_overhead.py: kiln `strategy: {name: model_parallel, mesh: {ep: 2}}`
against the expert-parallel loop one writes by hand, on a small Mixtral (MixtralConfig: hidden 128, 2
layers, 8 experts of which each token takes 2, vocab 256, sequences of 64, batch 8 per rank).

The hand-written loop does what torchtitan's ExpertParallel does, for transformers' fused experts: each
rank keeps its slice of every layer's expert weights as plain tensors, and the experts module's forward
sorts the (token, expert) pairs by expert, exchanges the counts with one `all_to_all_single`, sends the
rows to the experts' ranks and back with two more (an autograd function whose backward is the reverse
all-to-all), runs each local expert (transformers' own gate) and weights each pair's output. Each rank
reads its own batches; the loss is the global item-count mean (one all-reduce of the window's items,
as kiln); the replicated gradients are averaged with one flat all-reduce and the experts' divided by ep;
the global 2-norm (replicated once, the expert shards' squares all-reduced) is clipped to 1.0; AdamW
without weight decay (kiln's default, as HF's; torch's own default is 0.01) and a linear schedule. On the
CPU both sides step AdamW with torch's per-parameter kernels: torch picks them for CPU tensors, and kiln's
fused default falls back to them for a param group that mixes DTensors (the experts) with plain tensors."""

from __future__ import annotations

import statistics
import time
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.ddp_overhead import TARGET, _durations, device, kiln_loop, lm_data

BATCH = 8


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    return MixtralForCausalLM(config)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty(sum(out_splits), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None


def _forward(self: Any, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    ep, local = dist.get_world_size(), self.w1.shape[0]
    tokens, k = idx.shape
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=ep * local)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    send, got_per = counts.view(ep, local).sum(1).tolist(), got.view(ep, local)
    recv = got_per.sum(1).tolist()
    rows = _AllToAll.apply(hidden[order // k], recv, send)
    expert = torch.arange(local).repeat(ep).repeat_interleave(got_per.reshape(-1))
    regroup = expert.argsort(stable=True)
    outs = [
        nn.functional.linear(self._apply_gate(nn.functional.linear(part, self.w1[e])), self.w2[e])
        for e, part in enumerate(rows[regroup].split(got_per.sum(0).tolist()))
    ]
    out = torch.empty_like(rows[:, : self.w2.shape[1]])
    out[regroup] = torch.cat(outs)
    back = _AllToAll.apply(out, send, recv)
    pairs = torch.empty_like(back)
    pairs[order] = back
    return (pairs.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1).to(hidden.dtype)


def shard_by_hand(model: nn.Module) -> list[nn.Parameter]:
    """Each experts module keeps this rank's rows of its weights; returns those (the expert) parameters."""
    rank, ep = dist.get_rank(), dist.get_world_size()
    experts = []
    for layer in model.model.layers:
        module = layer.mlp.experts
        local = module.num_experts // ep
        mine = slice(rank * local, (rank + 1) * local)
        module.w1 = nn.Parameter(module.gate_up_proj.detach()[mine].clone())
        module.w2 = nn.Parameter(module.down_proj.detach()[mine].clone())
        del module.gate_up_proj, module.down_proj
        module.forward = types.MethodType(_forward, module)
        experts += [module.w1, module.w2]
    return experts


def raw_loop(model: nn.Module, data: list, steps: int) -> list[tuple[float, float]]:
    """The hand-written expert-parallel loop; (wall, cpu) seconds of each step after the warm-up."""
    dev, ep = device(), dist.get_world_size()
    model = model.to(dev)
    for p in model.parameters():  # every rank starts from rank 0's weights
        dist.broadcast(p.data, 0)
    experts = shard_by_hand(model)
    mine = {id(p) for p in experts}
    replicated = [p for p in model.parameters() if id(p) not in mine]
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)  # kiln's (HF's) default; torch's own is 0.01
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)
    model.train()
    step, ends = 0, []
    while step < steps:
        for b in loader:
            b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
            items = (b["labels"][:, 1:] != -100).sum()
            dist.all_reduce(items)
            loss = model(**b, num_items_in_batch=items).loss * ep
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in replicated])
            dist.all_reduce(flat)
            flat /= ep
            for p, part in zip(replicated, flat.split([p.numel() for p in replicated])):
                p.grad.copy_(part.view_as(p))
            torch._foreach_div_([p.grad for p in experts], ep)
            shard = torch.stack([p.grad.pow(2).sum() for p in experts]).sum()
            dist.all_reduce(shard)
            norm = (shard + torch.stack([p.grad.pow(2).sum() for p in replicated]).sum()).sqrt()
            torch._foreach_mul_([p.grad for p in params], torch.clamp(1.0 / (norm + 1e-6), max=1.0))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ends.append((time.perf_counter(), time.process_time()))
            if step == steps:
                break
    return _durations(ends)


def ep_overhead(steps: int, repeats: int) -> None:
    data = lm_data(seq=64)
    ep = {"name": "model_parallel", "mesh": {"ep": 2}}
    raw_t: list[tuple[float, float]] = []
    kiln_t: list[tuple[float, float]] = []
    for _ in range(repeats):
        torch.manual_seed(0)
        raw_t += raw_loop(mixtral(), data, steps)
        torch.manual_seed(0)
        kiln_t += kiln_loop(mixtral(), data, BATCH, steps, strategy=ep)
    if dist.get_rank() == 0:
        for i, clock in ((0, "wall"), (1, "cpu ")):
            r, k = statistics.median(t[i] for t in raw_t), statistics.median(t[i] for t in kiln_t)
            verdict = "OK" if k / r <= TARGET else "OVER TARGET"
            print(
                f"mixtral 2x128 8 experts ep 2 {clock} hand-written {r * 1e3:8.3f} ms/step   kiln {k * 1e3:8.3f} "
                f"ms/step   ratio {k / r:.3f} (target <= {TARGET}) {verdict}",
                flush=True,
            )
