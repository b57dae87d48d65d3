"""`predict` with `predict_with_generate` under FSDP on every rank, for a tiny GPT-2 built from a
config, next to generate() called by hand on the same (unsharded) model in this process. The
end-of-sequence id is picked so that one rank's batches stop early and the other's run on: the
ranks call forward a different number of times unless generation is synced across them.
Rank 0 writes OUT/result.json.  Run by worker_many.py (`main(OUT)` on every rank)"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from kiln import Trainer  # noqa: E402

NEW = 6


def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        )
    ).eval()


g = torch.Generator().manual_seed(1)
ids = torch.randint(1, 64, (8, 5), generator=g)
rows = [{"input_ids": ids[i], "attention_mask": torch.ones(5, dtype=torch.long), "labels": ids[i]} for i in range(8)]
plain = model()
BATCHES = {0: ((0,), (2,), (4,), (6,)), 1: ((1,), (3,), (5,), (7,))}  # the eval sampler's rows per rank


def generate(rows_, **kw):
    with torch.no_grad():
        return plain.generate(
            input_ids=ids[list(rows_)],
            attention_mask=torch.ones(len(rows_), 5, dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
            **kw,
        )[:, 5:]


free = {b: generate(b, eos_token_id=None) for batches in BATCHES.values() for b in batches}


def steps(batch, token):  # forward calls until every row of the batch has produced `token`
    return max((row == token).nonzero()[0].item() + 1 if (row == token).any() else NEW for row in free[batch])


def imbalance(token):
    return abs(sum(steps(b, token) for b in BATCHES[0]) - sum(steps(b, token) for b in BATCHES[1]))


eos = max(range(1, 64), key=imbalance)
by_hand = {str(b): generate(b, eos_token_id=eos).tolist() for batches in BATCHES.values() for b in batches}


def main(out: str) -> None:
    trainer = Trainer(
        model(),
        {
            "output_dir": os.path.join(out, "run"),
            "per_device_eval_batch_size": 1,
            "predict_with_generate": True,
            "log": {"disable_tqdm": True},
            "strategy": {"name": "fsdp", "device": "cpu"},
        },
    )
    pred = trainer.predict(rows, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(
                {
                    "predictions": pred.predictions.tolist(),
                    "by_hand": by_hand,
                    "prompts": ids.tolist(),
                    "eos": eos,
                    "imbalance": imbalance(eos),
                    "sharded": type(trainer.strategy).__name__,
                },
                fh,
            )
