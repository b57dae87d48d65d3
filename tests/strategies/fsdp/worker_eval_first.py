"""evaluate -> fit -> evaluate under `fsdp` with shard_grad_op (no resharding after forward), and the
same fit without the first evaluation; rank 0 writes both final eval losses to OUT/losses.json.
Usage: torchrun --nproc_per_node=2 worker_eval_first.py OUT"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402

from kiln import Trainer  # noqa: E402
from tests.strategies.contract.scenarios import ContractNet, config, token_data  # noqa: E402

out = sys.argv[1]
world = int(os.environ.get("WORLD_SIZE", "1"))
losses = {}
for name, evaluate_first in (("eval_first", True), ("plain", False)):
    cfg = config(os.path.join(out, name), name, world)
    cfg["strategy"] = {"device": "cpu", "name": "fsdp", "sharding": "shard_grad_op"}
    torch.manual_seed(0)
    trainer = Trainer(ContractNet(), cfg, train_dataset=token_data(40, seed=1), eval_dataset=token_data(7, seed=2))
    before = trainer.evaluate()["eval_loss"] if evaluate_first else None
    trainer.fit()
    losses[name] = {"before": before, "after": trainer.evaluate()["eval_loss"]}
if trainer.strategy.is_global_zero:
    with open(os.path.join(out, "losses.json"), "w") as fh:
        json.dump(losses, fh)
