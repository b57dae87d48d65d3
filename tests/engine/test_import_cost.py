"""`import kiln` stays cheap: it imports neither torch nor the config machinery (omegaconf, yaml) nor
any optional package, and `from kiln import Trainer` imports no optional package either: trackers,
DeepSpeed, Transformers, Optuna and safetensors load when a run uses them. Nor does it import omegaconf
(~0.2 s): that loads where a config is built or merged (`load_config`, a Trainer being constructed), nor
torch.distributed.tensor (~1 s), which loads where DTensors are used. Checked with sys.modules in
a fresh interpreter, not with timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONAL = (
    "transformers",
    "deepspeed",
    "accelerate",
    "tensorboard",
    "torch.utils.tensorboard",
    "mlflow",
    "wandb",
    "optuna",
    "safetensors",
    "lightning",
    "datasets",
    "matplotlib",
    "pandas",
)
CODE = f"""
import json, sys
names = {(*OPTIONAL, "torch", "omegaconf", "yaml", "torch.distributed.tensor")!r}
import kiln
after_import = [m for m in names if m in sys.modules]
from kiln import Trainer, TrainingModule, Callback, TrainingConfig
after_trainer = [m for m in names if m in sys.modules]
from kiln import load_config
after_load_config = [m for m in names if m in sys.modules]
print(json.dumps([after_import, after_trainer, after_load_config]))
"""


def test_import_kiln_pulls_in_nothing_heavy_and_trainer_nothing_optional():
    result = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    after_import, after_trainer, after_load_config = json.loads(result.stdout.strip().splitlines()[-1])
    assert after_import == []
    assert [m for m in after_trainer if m in OPTIONAL] == []
    assert "omegaconf" not in after_trainer, "from kiln import Trainer must not import omegaconf"
    # ~1 s on 2 cores: loaded by the mesh strategies and the optimizer step only when DTensors are in play
    assert "torch.distributed.tensor" not in after_trainer
    assert "omegaconf" in after_load_config  # the probe can see omegaconf once something really needs it
