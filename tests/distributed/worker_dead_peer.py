"""2-process worker without a launcher agent (the environment variables set by hand, as srun or a
script would): rank DIE_RANK kills itself with SIGKILL at step 2 after writing its pid to OUT/pid;
the survivor's collective then fails, long before the 300 s collective timeout that a hang would wait
for. Usage: worker_dead_peer.py OUT DIE_RANK"""

import os
import signal
import sys

import torch
import toy

from kiln import Callback, Trainer

out, die_rank = sys.argv[1], int(sys.argv[2])


class Die(Callback):
    def on_step_end(self, config, state, control, **kw):
        if state.global_step == 2 and int(os.environ["RANK"]) == die_rank:
            with open(os.path.join(out, "pid"), "w") as fh:
                fh.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
cfg = toy.scenario_config(
    "plain", out, world=2, max_steps=1000, strategy={"name": "ddp", "device": "cpu", "timeout": 300}
)
Trainer(toy.Regressor(), cfg, train_dataset=toy.regression_data(64), callbacks=[Die()]).fit()
print("unreachable: training finished", flush=True)
