"""The pp rows of bench/model_parallel_overhead.py (`--axis pp`): kiln's pipeline against a hand-written
`torch.distributed.pipelining` loop, each schedule's bubble, and per-rank memory for pp 2 against dp 2.

    python bench/model_parallel_overhead.py --axis pp [--steps 30] [--repeats 3] [--schedules gpipe 1f1b ...]
        [--mem-dim 512] [--mem-layers 8] [--memory-only]
    python bench/model_parallel_overhead.py --axis pp --nproc 4 [--schedules 1f1b]   # pp 2 x dp_shard 2

1. Per-step time on a small Llama (hidden 128, 4 layers, 4 heads, vocab 256, sequences of 64), windows
   of 4 micro-batches of 4 sequences, on 2 processes: kiln `strategy: {name: model_parallel, mesh: {pp: 2},
   pipeline: {schedule: S}}` against the loop one writes by hand with torch's pipelining API: the model
   cut by hand (rank 0 the embeddings and layers 0-1, rank 1 layers 2-3, the norm and the head; for the
   2-stage-a-rank schedules, one layer a stage, placed as torch places them), one `PipelineStage` per
   stage, the same schedule class, the loss the model's own `loss_function` (the mean cross entropy of
   each micro-batch's shifted labels, as kiln's last stage computes it), the global
   gradient norm (one all-reduce) clipped to 1.0, AdamW and a linear schedule. Both ranks read the same
   batches. With `--nproc 4`, pp 2 x dp_shard 2: kiln `mesh: {pp: 2, dp_shard: 2}` against the same loop
   with each stage FSDP2-sharded over its dp_shard ranks (each decoder layer a unit, then the stage), as
   torchtitan does, each dp_shard rank reading its own batches. Both sides step AdamW as kiln's default
   does (the fused kernel, no weight decay). Interleaved repeats; medians of the per-step times after a warm-up, on rank 0, in wall-clock
   and in this process's CPU time. Target: CPU-time ratio <= 1.05.
2. The bubble: each rank's idle time per step, wall time minus this process's CPU time (one thread a
   process; gloo's waits sleep), in kiln's runs, beside the textbook fraction.
3. Peak memory per rank for a Llama whose parameters + AdamW state dominate (`mem-layers` layers of
   hidden `mem-dim`, a window of 2 micro-batches of 1 sequence of 16): kiln pp 2 (1f1b) against kiln ddp
   (dp 2), each in a fresh job, measured as bench/fsdp_overhead.py does (the growth of ru_maxrss with
   glibc's mmap threshold pinned; on GPUs max_memory_allocated).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.ddp_overhead import TARGET, _durations, device, lm_data, timed_fit
from bench.fsdp_overhead import report_peak

MICRO, WINDOW, PP = 4, 4, 2
#: the textbook bubble fraction for pp 2 and a window of 4: (p - 1) / (m + p - 1), over v stages a rank
#: for the interleaved ones; the zero-bubble schedules fill it with weight-gradient work
TEXTBOOK = {"gpipe": 1 / 5, "1f1b": 1 / 5, "interleaved_1f1b": 1 / 9, "interleaved_zb": 0.0, "zbv": 0.0}


def llama(hidden: int = 128, layers: int = 4, inter: int = 256) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class HandStage(nn.Module):
    """One stage cut by hand: the embeddings on the first, some decoder layers, the norm and head on the last."""

    def __init__(self, model: Any, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary = inner.rotary_emb
        self.norm: nn.Module | None = inner.norm if last else None
        self.head: nn.Module | None = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary(h, positions)
        mask = create_causal_mask(
            config=self.rotary.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions
        )
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        return self.head(self.norm(h)) if self.head is not None and self.norm is not None else h


def placement(schedule: str, pp: int, rank: int) -> tuple[int, list[int]]:
    """(stage count, the stages of pp rank `rank`) as torch places them."""
    from kiln.strategies.mesh.pipeline_settings import read_pipeline
    from kiln.strategies.mesh.pipeline_split import stage_owners

    p = read_pipeline({"schedule": schedule})
    count = p.stages(pp)
    owners = stage_owners(pp, count, p.style)
    return count, [s for s in range(count) if owners[s] == rank]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def raw_loop(schedule: str, model: Any, data: list, steps: int) -> list[tuple[float, float]]:
    """The hand-written pipeline loop; (wall, cpu) seconds of each step after the warm-up. On 4 processes,
    pp 2 x dp_shard 2 as torchtitan writes it: a (pp, dp_shard) mesh, each stage's decoder layers and
    then the stage FSDP2 units over its dp_shard ranks (kept gathered from forward to backward), the
    stages over the pp group, each dp_shard rank reading its own batches."""
    from torch.distributed.pipelining import PipelineStage

    from kiln.strategies.mesh.pipeline_schedule import schedule_class

    dev, dp = device(), dist.get_world_size() // PP
    mesh = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (PP, dp), mesh_dim_names=("pp", "dp_shard"))
    count, mine = placement(schedule, PP, mesh["pp"].get_local_rank() if mesh is not None else dist.get_rank())
    per = len(model.model.layers) // count
    stages = [HandStage(model, list(range(s * per, (s + 1) * per)), s == 0, s == count - 1).to(dev) for s in mine]
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for stage in stages:
            for layer in stage.layers:
                fully_shard(layer, mesh=mesh["dp_shard"], reshard_after_forward=False)
            fully_shard(stage, mesh=mesh["dp_shard"], reshard_after_forward=False)
    group = mesh["pp"].get_group() if mesh is not None else None
    pipe = [PipelineStage(m, s, count, dev, group=group) for m, s in zip(stages, mine)]
    params = [p for m in stages for p in m.parameters()]
    vocab = model.config.vocab_size

    loss_function = model.loss_function

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the model's own loss (Transformers' causal-LM loss, which shifts the labels), as kiln's last
        # stage computes it: the mean over the micro-batch's items, the schedule dividing by the window
        return loss_function(logits=logits, labels=labels, vocab_size=vocab)

    cls = schedule_class(schedule, WINDOW, PP)
    sched_obj = cls(pipe if len(pipe) > 1 else pipe[0], n_microbatches=WINDOW, loss_fn=loss_fn)
    # kiln's default optimizer (HF's): adamw_torch_fused without weight decay, which kiln keeps fused here
    # (one mesh, or plain tensors); torch's own default is the per-parameter kernel on CPU and decay 0.01
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    sampler: Any = None
    if mesh is not None:  # each dp_shard rank its own batches; both stages of a data shard the same ones
        dp_rank = mesh["dp_shard"].get_local_rank()
        sampler = torch.utils.data.DistributedSampler(data, dp, dp_rank, shuffle=True, seed=0, drop_last=True)
    order = torch.Generator().manual_seed(0)
    loader: Any = torch.utils.data.DataLoader(
        data,
        batch_size=MICRO * WINDOW,
        shuffle=sampler is None,
        sampler=sampler,
        generator=order if sampler is None else None,
        drop_last=True,
    )
    first, last = any(s.is_first for s in pipe), any(s.is_last for s in pipe)
    step, ends = 0, []
    while step < steps:
        for b in loader:
            ids, labels = b["input_ids"].to(dev), b["labels"].to(dev)
            sched_obj.step(*((ids,) if first else ()), target=labels if last else None, losses=[] if last else None)
            grads = [_local(p.grad) for p in params if p.grad is not None]  # FSDP: this rank's shards
            norm = torch.stack([g.pow(2).sum() for g in grads]).sum()
            dist.all_reduce(norm)  # every stage's, every shard's squares
            torch._foreach_mul_(grads, torch.clamp(1.0 / (norm.sqrt() + 1e-6), max=1.0))
            opt.step()
            lr.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ends.append((time.perf_counter(), time.process_time()))
            if step == steps:
                break
    return _durations(ends)


def kiln_loop(schedule: str, model: Any, data: list, steps: int) -> list[tuple[float, float]]:
    cfg = {
        "max_steps": steps,
        "per_device_train_batch_size": MICRO,
        "gradient_accumulation_steps": WINDOW,
        "learning_rate": 1e-4,
        "max_grad_norm": 1.0,
        "logging_steps": 50,
        "save_strategy": "no",
        "dataloader_drop_last": True,
        "log": {"history": []},
        "strategy": {"name": "model_parallel", "mesh": kiln_mesh(), "pipeline": {"schedule": schedule}},
    }
    durations, trainer = timed_fit(model, data, cfg)
    trainer.teardown()  # type: ignore[attr-defined]
    return durations


def kiln_mesh() -> dict[str, int]:
    """pp 2 on 2 processes; pp 2 x dp_shard 2 on 4."""
    dp = dist.get_world_size() // PP
    return {"pp": PP} if dp == 1 else {"pp": PP, "dp_shard": dp}


def overhead(steps: int, repeats: int, schedules: list[str]) -> None:
    data = lm_data(seq=64)
    for schedule in schedules:
        raw_t: list[tuple[float, float]] = []
        kiln_t: list[tuple[float, float]] = []
        for _ in range(repeats):
            torch.manual_seed(0)
            raw_t += raw_loop(schedule, llama(), data, steps)
            torch.manual_seed(0)
            kiln_t += kiln_loop(schedule, llama(), data, steps)
        idle = [w - c for w, c in kiln_t]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (statistics.median(idle), statistics.median(w for w, _ in kiln_t)))
        label = " x ".join(f"{axis} {n}" for axis, n in kiln_mesh().items())
        ranks = " / ".join(f"rank {r}" for r in range(dist.get_world_size()))
        if dist.get_rank() == 0:
            for i, clock in ((0, "wall"), (1, "cpu ")):
                r, k = statistics.median(t[i] for t in raw_t), statistics.median(t[i] for t in kiln_t)
                verdict = "OK" if k / r <= TARGET else "OVER TARGET"
                print(
                    f"llama 4x128 {label} {schedule:16s} {clock} hand-written {r * 1e3:8.3f} ms/step   kiln "
                    f"{k * 1e3:8.3f} ms/step   ratio {k / r:.3f} (target <= {TARGET}) {verdict}",
                    flush=True,
                )
            bubbles = " / ".join(f"{i * 1e3:.1f} ms ({i / w:.0%})" for i, w in every)
            print(
                f"llama 4x128 {label} {schedule:16s} bubble (idle per step, {ranks}): {bubbles}; "
                f"textbook {TEXTBOOK[schedule]:.0%}",
                flush=True,
            )


def peak_memory(kind: str, dim: int, layers: int) -> None:
    """One kiln run of a wide Llama under pp 2 or dp 2; rank 0 prints every rank's peak as JSON. The
    model is built inside the measure: pp builds it whole, then keeps its stages."""
    import importlib

    for name in ("kiln.strategies.ddp.strategy", "kiln.strategies.model_parallel.strategy", "transformers"):
        importlib.import_module(name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (8, 17), generator=g)
    data = [{"input_ids": ids[i, :-1], "labels": ids[i, 1:]} for i in range(8)]
    strategy: dict[str, Any] = (
        {"name": "model_parallel", "mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b"}}
        if kind == "pp2"
        else {"name": "ddp"}
    )
    cfg = {
        "max_steps": 2,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-4,
        "save_strategy": "no",
        "log": {"history": []},
        "strategy": strategy,
    }

    def run() -> None:
        torch.manual_seed(0)
        timed_fit(llama(hidden=dim, layers=layers, inter=2 * dim), data, cfg)

    report_peak(kind, run)
