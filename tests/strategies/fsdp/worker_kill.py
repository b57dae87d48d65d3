"""Sharded FSDP checkpoints under SIGKILL. Usage: torchrun --nproc_per_node=2 worker_kill.py OUT MODE
- `kill`: trains full_shard saving every 2 steps; the save of checkpoint-4 is blocked for good inside
  torch.distributed.checkpoint, after every rank wrote its shard and before rank 0 writes the
  `.metadata` (so before kiln's COMPLETE marker); rank 0 then creates OUT/blocked and the test kills
  both ranks (their pids are in OUT/pid0, OUT/pid1). A hook, not timing: the kill always lands inside that save.
- `resume`: resumes OUT/run with resume_from_checkpoint=true to step 6, then trains an uninterrupted
  run in OUT/straight; rank 0 writes both final weights and OUT/resumed_at (the step it resumed from)."""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.checkpoint import filesystem  # noqa: E402

from kiln import Callback  # noqa: E402
from tests.strategies.fsdp import cases  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
EXTRA = {"save": {"strategy": "steps", "steps": 2}, "strategy": {**cases.FSDP, "state_dict_type": "sharded"}}

if mode == "kill":
    with open(os.path.join(out, f"pid{os.environ['RANK']}"), "w") as fh:
        fh.write(str(os.getpid()))
    finish, calls = filesystem._FileSystemWriter.finish, []

    def blocked_finish(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the checkpoint-4 save (runs on the coordinator, rank 0)
            with open(os.path.join(out, "blocked"), "w") as fh:
                fh.write(str(os.getpid()))
            while True:
                time.sleep(1)
        return finish(self, *args, **kwargs)

    filesystem._FileSystemWriter.finish = blocked_finish
    cases.trainer_for("full_shard", os.path.join(out, "run"), 2, **EXTRA).fit()
    raise SystemExit("not reached: the save of checkpoint-4 blocks until the job is killed")


class ResumedAt(Callback):
    def on_train_begin(self, config, state, control, **kw):
        self.step = state.global_step


resumed = cases.trainer_for("full_shard", os.path.join(out, "run"), 2, resume_from_checkpoint="true", **EXTRA)
at = ResumedAt()
resumed.add_callback(at)
resumed.fit()
weights = {"resumed": cases.full_weights(resumed)}
straight = cases.trainer_for("full_shard", os.path.join(out, "straight"), 2, **EXTRA)
straight.fit()
weights["straight"] = cases.full_weights(straight)
if dist.get_rank() == 0:
    for name, w in weights.items():
        save_file(w, os.path.join(out, f"{name}.safetensors"))
    with open(os.path.join(out, "resumed_at"), "w") as fh:
        fh.write(str(at.step))
dist.barrier()
dist.destroy_process_group()
