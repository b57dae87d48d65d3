"""The 2-node leg of tests/checkpoint/test_remote_nodes.py, on both ranks of a gloo world that fakes two
nodes: each rank is node rank RANK's only process (local rank 0) with a staging folder of its own,
ROOT/<run>/node<RANK>, that the other "node" never reads. Usage: remote_nodes_worker.py ROOT URL ENDPOINT

- ROOT/straight: the same training, uninterrupted, in one shared local output_dir (checkpoint-6).
- URL-sync, URL-async (save.async_save): FSDP (sharded DCP) saves to the store from the two nodes'
  staging folders (ROOT/<variant>/node<RANK>) and stops after saving step 4 (Crash); then resumes from the
  store and trains to step 6: sync on two fresh nodes (ROOT/sync-resumed/node<RANK>), async restarted on
  the same two, whose staging folders hold each its own node's part of the checkpoint. Each rank logs every file it puts on the store, with the time, in ROOT/puts_<RANK>.json."""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tests.checkpoint.store_world import one_process_per_node, store_options  # noqa: E402

RANK = one_process_per_node()

import s3fs  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.checkpoint.checkpoint_helpers import train  # noqa: E402
from tests.checkpoint.test_cross_format_resume import CHAIN, STRATEGIES, Crash  # noqa: E402

root, url, endpoint = sys.argv[1:4]
options = store_options(endpoint)
puts: list[tuple[str, float]] = []
fs = s3fs.S3FileSystem(**options)  # fsspec's cached instance: the one the runs upload through
put_file, pipe_file = fs.put_file, fs.pipe_file
fs.put_file = lambda src, dst, **kw: (put_file(src, dst, **kw), puts.append((dst, time.time())))[0]
fs.pipe_file = lambda dst, data, **kw: (pipe_file(dst, data, **kw), puts.append((dst, time.time())))[0]
cfg = {**CHAIN["cfg"], "strategy": STRATEGIES["fsdp-sharded"], "per_device_train_batch_size": 2}


def run(out: str, staging: str | None, resume: object = None, crash_at: int | None = None, **more: object) -> None:
    save = {"on_each_node": True, "storage_options": options, "staging_dir": staging, "total_limit": 2, **more}
    save = save if staging else {}
    try:
        train(out, {**cfg, "save": save}, resume=resume, model_kw=CHAIN["model_kw"], crash_at=crash_at)
    except Crash:
        pass


run(os.path.join(root, "straight"), None)
for variant, background in (("sync", False), ("async", True)):
    run(f"{url}-{variant}", os.path.join(root, variant, f"node{RANK}"), crash_at=4, async_save=background)
    again = variant if background else f"{variant}-resumed"  # async: restarted on the same nodes, sync: fresh ones
    run(f"{url}-{variant}", os.path.join(root, again, f"node{RANK}"), resume=True, async_save=background)
with open(os.path.join(root, f"puts_{RANK}.json"), "w") as fh:
    json.dump(puts, fh)
dist.destroy_process_group()
