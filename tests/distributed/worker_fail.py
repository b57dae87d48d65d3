"""2-process worker that trains until rank 1 dies by SIGKILL at step 2 (the other rank is then
inside the gradient all-reduce of step 3). Works under torchrun or with the env vars set by hand.
Usage: worker_fail.py OUT"""

import os
import signal
import sys

import torch
import toy

from kiln import Callback, Trainer


class Die(Callback):
    def on_step_end(self, config, state, control, **kw):
        if state.global_step == 2 and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
cfg = toy.scenario_config(
    "plain", sys.argv[1], world=2, max_steps=1000, strategy={"name": "ddp", "device": "cpu", "timeout": 60}
)
Trainer(toy.Regressor(), cfg, train_dataset=toy.regression_data(64), callbacks=[Die()]).fit()
print("unreachable: training finished", flush=True)
