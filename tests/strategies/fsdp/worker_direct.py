"""A TrainingModule under FSDP on every rank, called directly after `fit` (`model(ids)` and
`model.generate(...)`, as a callback or a user's script does) rather than through the Trainer's loops,
next to the same weights unsharded in this process. Rank 0 writes OUT/result.json.
Run by worker_many.py (`main(OUT)` on every rank)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from examples.char_lm.model import CharGPT  # noqa: E402
from kiln import Trainer  # noqa: E402

SIZES = {"vocab_size": 16, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


def main(out: str) -> None:
    torch.manual_seed(0)
    model = CharGPT(**SIZES)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x[:-1], "labels": x[1:]} for x in torch.randint(1, 16, (8, 9), generator=g)]
    trainer = Trainer(
        model,
        {
            "output_dir": os.path.join(out, "run"),
            "max_steps": 2,
            "per_device_train_batch_size": 2,
            "learning_rate": 0.1,
            "log": {"disable_tqdm": True},
            "save": {"strategy": "no"},
            "strategy": {"name": "fsdp", "device": "cpu", "wrap": ["Block"]},
        },
        train_dataset=rows,
    )
    trainer.fit()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        direct = model(ids)
    generated = model.generate(ids, max_new_tokens=4, temperature=0)
    weight = model.tok_emb.weight  # held by the root's unit: sharded again after the direct calls
    sharded = isinstance(weight, DTensor) and weight.to_local().shape[0] < weight.shape[0]
    trainer.save_model(os.path.join(out, "full"))
    dist.barrier()
    plain = CharGPT(**SIZES)
    plain.load_state_dict(
        load_file(os.path.join(out, "full", "model.safetensors")), strict=False
    )  # head tied to tok_emb
    with torch.no_grad():
        expected = plain(ids)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(
                {
                    "max_diff": float((direct - expected).abs().max()),
                    "generated": generated.tolist(),
                    "expected": plain.generate(ids, max_new_tokens=4, temperature=0).tolist(),
                    "sharded_after": sharded,
                    "trained": trainer.state.global_step,
                },
                fh,
            )
