"""2-process worker for tests/distributed/test_ddp_packing.py: packed training under DDP over a dataset and
over a stream, and under FSDP with the chunked loss and checkpointing; rank 0 writes the weights and per-rank facts to OUT. Usage: torchrun ... worker_packing.py OUT"""

import json
import os
import sys

import packing_toy
import torch
import toy
from safetensors.torch import save_file

out = sys.argv[1]
results, tensors = {}, {}
FSDP = {**packing_toy.CHUNKED_AND_CHECKPOINTED, "strategy": {"name": "fsdp", "device": "cpu"}}
for name, stream in (("rows", False), ("stream", True), ("chunked", False), ("fsdp", False)):
    extra = {"chunked": packing_toy.CHUNKED_AND_CHECKPOINTED, "fsdp": FSDP}.get(name, {})
    trainer = packing_toy.train(os.path.join(out, name), world=2, stream=stream, **extra)
    if name == "fsdp":  # the shards gathered (on rank 0; FSDP's ranks hold one model by construction)
        state = trainer.strategy.model_state_for_export(trainer.model)
        names = [n for n, _ in trainer.model.named_parameters()]
        flat = torch.cat([state[n].flatten() for n in names]) if state else torch.zeros(0)
    else:
        flat = toy.flat_params(trainer.model)
    every = trainer.strategy.all_gather(flat) if name != "fsdp" else flat.expand(2, -1)
    first = next(iter(trainer.get_train_dataloader()))["input_ids"].tolist()
    results[name] = {
        "ranks_identical": bool((every == every[0]).all()),
        "steps": trainer.state.global_step,
        "first_batches": trainer.strategy.all_gather_object(first),
        "chunked": hasattr(trainer.model.forward, "_kiln_plain_forward"),
        "checkpointed": sum(bool(getattr(m, "_kiln_checkpointed", False)) for m in trainer.model.modules()),
    }
    tensors[name] = flat
if trainer.strategy.global_rank == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "results.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
