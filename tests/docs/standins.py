"""The objects a docs page means when it says `model`, `train`, `MyModel`, ...: tiny stand-ins a code
block runs against. A 64-feature, 10-class classification set (what README's Classifier expects) and
an MLP that returns its loss (a TrainingModule, so it also answers `validation_step`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln import TrainingModule

FEATURES, CLASSES = 64, 10


class MyModel(TrainingModule):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))

    def training_step(self, batch: dict) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["x"]), batch["labels"])

    def validation_step(self, batch: dict) -> dict:
        logits = self.net(batch["x"])
        return {"loss": F.cross_entropy(logits, batch["labels"]), "logits": logits, "labels": batch["labels"]}


class ToyDataset(list):
    """A list of samples with the one `datasets.Dataset` method the pages call."""

    def map(self, fn: Any) -> "ToyDataset":
        return ToyDataset(fn(sample) for sample in self)


def classification(n: int, seed: int) -> ToyDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    labels = (x[:, :CLASSES].argmax(-1))  # learnable: the largest of the first ten features
    return ToyDataset({"x": x[i], "labels": labels[i]} for i in range(n))


def build_data() -> dict[str, Any]:
    """`task.data` of the stand-in config.yaml (what `kiln fit config.yaml` trains)."""
    return {"train_dataset": classification(96, 0), "eval_dataset": classification(32, 1)}


CONFIG_YAML = """\
task:
  model: tests.docs.standins:MyModel
  data: tests.docs.standins:build_data
output_dir: yaml-run
max_steps: 4
per_device_train_batch_size: 16
eval_strategy: steps
eval_steps: 2
save_strategy: "no"
disable_tqdm: true
"""


def namespace(folder: Path) -> dict[str, Any]:
    """A block's globals: the stand-ins, and a config.yaml written into `folder` (the block's cwd)."""
    (folder / "config.yaml").write_text(CONFIG_YAML)
    train, val, test = classification(96, 0), classification(32, 1), classification(32, 2)
    return {
        "__name__": "__main__", "MyModel": MyModel, "model": MyModel(),
        "train": train, "train_ds": train, "ds": train, "dataset": train, "val": val, "eval_ds": val, "test": test,
        "tokenize": lambda sample: sample,
        "config": {"output_dir": "run", "max_steps": 4, "save_steps": 2, "per_device_train_batch_size": 16,
                   "disable_tqdm": True},
    }
