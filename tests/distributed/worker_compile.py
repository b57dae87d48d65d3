"""2-process worker for compiled training under DDP and FSDP2: for each strategy, a hand-written
compiled loop (DDP: torch.compile of the DDP module; FSDP2: torchtitan's recipe, each block
torch.compile'd and swapped in, then fully_shard on the blocks and the root) counts graphs and
breaks over the shapes kiln will see; then kiln compiled and kiln uncompiled train the same model.
Each rank writes OUT/<rank>.json: the counts of both loops, the graphs after each kiln step and
evaluation, and how far the compiled weights are from the uncompiled ones.

Shapes per rank: 20 samples / 2 ranks = 10 in micro-batches of 4 -> 4, 4, 2, windows of 2 -> [4, 4] [2];
6 evaluation samples / 2 = 3 in batches of 2 -> 2, 1; 2 epochs.
MODEL is `blocks` (compile_toy.BlockLM, fast) or `gpt2` (a 2-layer GPT-2; minutes of tracing on 2 cores).
Usage: torchrun --nproc_per_node=2 worker_compile.py OUT MODEL [ddp] [fsdp]"""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_toy as toy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kiln import Trainer  # noqa: E402

out, which, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
LM = which == "gpt2"  # a causal LM that divides by num_items_in_batch itself


def make() -> torch.nn.Module:
    return toy.gpt2(2) if LM else toy.block_lm()


dist.init_process_group("gloo")  # kiln's strategies use this group (one the user made)
rank, world = dist.get_rank(), dist.get_world_size()
TRAIN, EVAL = toy.token_data(20), toy.token_data(6, seed=1)
MINE_TRAIN = toy.windows(toy.batches(TRAIN[: 20 // world], 4), 2)
MINE_EVAL = toy.batches(EVAL[: 6 // world], 2)


def hand_ddp() -> dict:
    toy.reset()
    model = make()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    compiled = torch.compile(ddp, backend=toy.BACKEND)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    toy.hand_loop(compiled, optimizer, MINE_TRAIN, MINE_EVAL, epochs=2, counts_items=LM, no_sync=ddp.no_sync)
    return toy.counts()


def hand_fsdp() -> dict:
    from torch.distributed.fsdp import fully_shard

    toy.reset()
    model = make()
    blocks = model.transformer.h if LM else model.h
    for name, block in list(blocks.named_children()):  # torchtitan's apply_compile, then apply_fsdp
        blocks.register_module(name, torch.compile(block, backend=toy.BACKEND))
    for block in blocks:
        fully_shard(block)
    fully_shard(model)

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    toy.hand_loop(model, optimizer, MINE_TRAIN, MINE_EVAL, epochs=2, counts_items=LM, no_sync=no_sync)
    return toy.counts()


def run_kiln(strategy: str, compiled: bool) -> tuple[dict, dict, torch.Tensor]:
    toy.reset()
    seen = toy.CountsPerStep()
    model = make()
    cfg = toy.kiln_config(
        os.path.join(out, f"{strategy}-{compiled}"), batch=4, eval_batch=2, strategy={"name": strategy, "device": "cpu"}
    )
    if not compiled:
        cfg["torch_compile_backend"] = None
    trainer = Trainer(model, cfg, train_dataset=TRAIN, eval_dataset=EVAL, callbacks=[seen])
    trainer.fit()
    assert trainer.state.global_step == 4, trainer.state.global_step
    weights = trainer.strategy.model_state_for_export(model)
    flat = toy.flat(v for _, v in sorted(weights.items())) if weights else torch.zeros(0)
    return (
        toy.counts(),
        {"steps": seen.steps, "evals": seen.evals, "wrapped": type(trainer.model_wrapped).__name__},
        flat,
    )


result: dict = {}
for case in cases:
    hand = hand_ddp() if case == "ddp" else hand_fsdp()
    got, seen, weights = run_kiln(case, compiled=True)
    _, _, eager = run_kiln(case, compiled=False)
    result[case] = {
        "hand": hand,
        "kiln": got,
        "seen": seen,
        "weights": int(weights.numel()),
        "max_diff": float((weights - eager).abs().max()) if weights.numel() else None,
    }
with open(os.path.join(out, f"{rank}.json"), "w") as fh:
    json.dump(result, fh)
dist.barrier()
dist.destroy_process_group()
