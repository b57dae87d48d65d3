"""2-process DDP run that saves at steps 2 and 4 while rank 1 is slow to write its per-rank state.
Usage: torchrun --nproc_per_node=2 worker_slow_rank_save.py OUT

Rank 1's rng_state() (called just before it writes rng_state_1.pth and loop_state_1.pt) waits until
the checkpoint's temporary folder disappears or WAIT_S pass. Correct code keeps that folder until every
rank has written (the "checkpoint-written" barrier), so rank 1 waits the full WAIT_S and then writes;
if rank 0 published without waiting, the folder is renamed under rank 1, which sees it vanish. Rank 1
records, per save, whether it did (OUT/rank1_saves.json); no timing guess decides the outcome."""

import glob
import json
import os
import sys
import time

import torch
import toy

from kiln import Trainer
from kiln.engine.checkpoint import manager

WAIT_S = 3.0
out = sys.argv[1]
run_dir = os.path.join(out, "run")
rank = int(os.environ["RANK"])
saves: list[dict] = []

if rank == 1:
    real_rng_state = manager.rng_state

    def slow_rng_state():
        tmp = glob.glob(os.path.join(run_dir, ".checkpoint-*.tmp"))
        deadline = time.monotonic() + WAIT_S
        while tmp and all(os.path.isdir(t) for t in tmp) and time.monotonic() < deadline:
            time.sleep(0.05)
        saves.append({"tmp_seen": bool(tmp), "tmp_vanished": any(not os.path.isdir(t) for t in tmp)})
        with open(os.path.join(out, "rank1_saves.json"), "w") as fh:
            json.dump(saves, fh)
        return real_rng_state()

    manager.rng_state = slow_rng_state

torch.manual_seed(0)
cfg = toy.scenario_config(
    "plain",
    run_dir,
    world=2,
    max_steps=4,
    save={"strategy": "steps", "steps": 2},
    strategy={"name": "ddp", "device": "cpu", "timeout": 120},
)
Trainer(toy.Regressor(), cfg, train_dataset=toy.regression_data(64)).fit()
