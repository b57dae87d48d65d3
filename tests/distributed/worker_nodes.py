"""Worker for a simulated 2-node job (two torchrun agents, one process each, c10d rendezvous): the
plain DDP scenario (its final weights to OUT/parity.safetensors), checkpoint writers with and without
save_on_each_node, log levels with and without log_on_each_node, and tracker/history files (global
rank 0 only). Each node saves under OUT/node<N> (a node-local disk) or OUT/shared.
Usage: worker_nodes.py OUT"""

import json
import logging
import os
import sys

import torch
import toy
from safetensors.torch import save_file

from kiln import Trainer
from kiln.launch.environment import detect

out = sys.argv[1]
env = detect()
report = {
    "node_rank": env.node_rank,
    "num_nodes": env.num_nodes,
    "local_rank": env.local_rank,
    "rank": env.rank,
    "master_addr": os.environ.get("MASTER_ADDR"),
}
_, model = toy.train_scenario("plain", os.path.join(out, "parity"), world=2)
if env.rank == 0:
    save_file({"params": toy.flat_params(model)}, os.path.join(out, "parity.safetensors"))
for name, on_each_node, output_dir in (
    ("each_node", True, os.path.join(out, f"node{env.node_rank}")),
    ("shared", False, os.path.join(out, "shared")),
):
    torch.manual_seed(0)
    # every local tracker and history file on: only global rank 0 may write them, never node 1's local rank 0
    cfg = toy.scenario_config(
        "plain",
        output_dir,
        world=2,
        max_steps=2,
        save={"strategy": "steps", "steps": 2, "on_each_node": on_each_node},
        log_level="info",
        log_level_replica="error",
        log_on_each_node=on_each_node,
        report_to=["tensorboard"],
        log={"history": ["csv", "jsonl"], "disable_tqdm": True, "steps": 1},
    )
    trainer = Trainer(toy.Regressor(), cfg, train_dataset=toy.regression_data(32))
    trainer.fit()
    report[name] = {
        "level": logging.getLogger("kiln").getEffectiveLevel(),
        "world_zero": trainer.is_world_process_zero(),
        "local_zero": trainer.is_local_process_zero(),
    }
with open(os.path.join(out, f"rank{env.rank}.json"), "w") as fh:
    json.dump(report, fh)
