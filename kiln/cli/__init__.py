"""`kiln fit|evaluate|predict CONFIG.yaml [key=value ...]`, `kiln plot`, `kiln config-docs`, `kiln convert`, `kiln estimate`.

The config names what to train by import path (`task.model`, `task.data`); overrides use
OmegaConf dotlist syntax, and Hugging Face TrainingArguments names work as keys.

- dispatch.py: `main`, the command table, the options of fit/evaluate/predict and where they run
  (Ray Train's workers, the local launcher, or this process); Ray's `train_loop_per_worker`
- run.py: one command in this process: config, task, then fit or score
- task.py: what `task.model` / `task.data` name, imported, checked and handed to the Trainer
- fit.py, score.py, convert.py: the commands' own work
- errors.py: how a failed command ends (one line, an exit code); help.py: the usage text"""

from __future__ import annotations

from kiln.cli.dispatch import main, train_loop_per_worker
from kiln.cli.fit import fit as _fit
from kiln.cli.score import pick_weights as _pick_weights
from kiln.cli.score import score as _score
from kiln.cli.task import DATA_KEYS

__all__ = ["DATA_KEYS", "_fit", "_pick_weights", "_score", "main", "train_loop_per_worker"]
