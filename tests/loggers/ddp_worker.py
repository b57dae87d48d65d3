"""2-process worker (torchrun): a short DDP run with every local logger on; rank 0 writes its
log_history next to the run. Usage: torchrun --nproc_per_node=2 ddp_worker.py OUTPUT_DIR"""

import json
import os
import sys

from kiln import Trainer
from tests.helpers import TinyRegressor, regression_data

out = sys.argv[1]
config = {
    "output_dir": out,
    "max_steps": 6,
    "learning_rate": 1e-2,
    "per_device_train_batch_size": 4,
    "report_to": ["tensorboard", "csv", "jsonl"],
    "log": {"steps": 2, "history": [], "disable_tqdm": True},
    "eval": {"strategy": "steps", "steps": 3},
    "save": {"strategy": "no"},
    "strategy": {"name": "ddp", "device": "cpu", "timeout": 60},
}
trainer = Trainer(TinyRegressor(), config, train_dataset=regression_data(64), eval_dataset=regression_data(16, seed=1))
trainer.fit()
if trainer.is_world_process_zero():
    with open(os.path.join(out, "log_history.json"), "w") as fh:
        json.dump(trainer.state.log_history, fh)
