"""Scenarios for accelerate's data options (split_batches, even_batches, dispatch_batches) shared by
the 2-process worker and the 1-process references in the test. `world=2` runs use DDP; `world=1`
runs one process with the global batch, which every 2-process scenario must reproduce exactly."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(os.path.dirname(HERE)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tests.distributed import toy  # noqa: E402

ITERATIONS: list[int] = []  # how often this process iterated a CountingStream


class CountingStream(toy.Stream):
    """A stream that cannot shard itself and counts who reads it."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        ITERATIONS.append(1)
        return iter(self.items)


# name -> (data factory, config for 2 ranks, config for 1 process); batches are per rank unless split
SCENARIOS: dict[str, dict[str, Any]] = {
    # the configured batch (8) is global: 4 per rank
    "split": {
        "data": lambda: toy.regression_data(32),
        "two": {"per_device_train_batch_size": 8, "split_batches": True},
        "one": {"per_device_train_batch_size": 8},
        "max_steps": 6,
    },
    # 23 samples, 2 per rank: the last step has 2 + 1 samples, none repeated
    "uneven": {
        "data": lambda: toy.regression_data(23),
        "two": {"per_device_train_batch_size": 2, "accelerator_config": {"even_batches": False}},
        "one": {"per_device_train_batch_size": 4},
        "epochs": 1,
    },
    # the same with even batches (the default): a repeated sample, so it must NOT match one process
    "even": {
        "data": lambda: toy.regression_data(23),
        "two": {"per_device_train_batch_size": 2},
        "one": {"per_device_train_batch_size": 4},
        "epochs": 1,
    },
    # 21 samples: the last global batch has 1 sample for 2 ranks, so it is left out on both
    "uneven_short": {
        "data": lambda: toy.regression_data(21),
        "two": {"per_device_train_batch_size": 2, "even_batches": False},
        "one": {"per_device_train_batch_size": 4},
        "epochs": 1,
        "one_data": 20,
    },
    # a stream that cannot shard itself: rank 0 reads it and sends each rank its half of every batch
    "dispatch": {
        "data": lambda: CountingStream(toy.regression_data(32)),
        "two": {"per_device_train_batch_size": 4, "dispatch_batches": True},
        "one": {"per_device_train_batch_size": 8},
        "max_steps": 6,
    },
    # dispatch with a split global batch and a last batch of 3 for 2 ranks, nothing repeated
    "dispatch_uneven": {
        "data": lambda: CountingStream(toy.regression_data(27)),
        "two": {
            "per_device_train_batch_size": 8,
            "accelerator_config": {"dispatch_batches": True, "split_batches": True, "even_batches": False},
        },
        "one": {"per_device_train_batch_size": 8},
        "max_steps": 8,
    },
}


def train(name: str, output_dir: str, world: int, resume: Any = None, **extra: Any) -> tuple[Any, torch.nn.Module]:
    from kiln import Trainer

    sc = SCENARIOS[name]
    cfg: dict[str, Any] = {
        "output_dir": output_dir,
        "seed": 3,
        "learning_rate": 1e-2,
        "optim": "sgd",
        "max_grad_norm": 0.0,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": {"name": "ddp" if world > 1 else "single", "device": "cpu"},
        **({"max_steps": sc["max_steps"]} if "max_steps" in sc else {"num_train_epochs": sc["epochs"]}),
        **(sc["two"] if world > 1 else sc["one"]),
        **extra,
    }
    data = sc["data"]()
    if world == 1 and "one_data" in sc:  # the samples the 2-rank run trains on, in its sampler's order
        from kiln.engine.data.samplers import ResumableSampler

        order = ResumableSampler(len(data), seed=3).indices()[: sc["one_data"]]
        data = torch.utils.data.DataLoader([data[i] for i in order], batch_size=4, shuffle=False)
    torch.manual_seed(0)
    model = toy.Regressor()
    trainer = Trainer(model, cfg, train_dataset=data)
    trainer.fit(resume_from_checkpoint=resume)
    return trainer, model
