"""Runs several of this folder's 2-process workers one after another in ONE world (each world costs its
processes' start-up: torch, kiln and DeepSpeed imports, DeepSpeed's accelerator and op checks).
Usage: torchrun --nproc_per_node=2 worker_chain.py SCRIPT OUT [CHECK ...] [+ SCRIPT OUT [CHECK ...]] ...
Each script runs as its own `__main__` with argv `OUT [CHECK ...]`; one that raises leaves OUT/error.txt
(rank 0) and the next still runs."""

import os
import runpy
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

jobs: list[list[str]] = [[]]
for arg in sys.argv[1:]:
    if arg == "+":
        jobs.append([])
    else:
        jobs[-1].append(arg)
for script, out, *checks in jobs:
    sys.argv = [os.path.join(HERE, script), out, *checks]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except Exception:
        print(f"worker_chain: {script} failed", file=sys.stderr, flush=True)
        if int(os.environ.get("RANK", "0")) == 0:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "error.txt"), "w") as fh:
                fh.write(traceback.format_exc())
