"""data.packing on a tiny Llama, shared by the 2-process worker and the 1-process reference: the same
packed rows (every rank plans the whole dataset alike; kiln's sampler deals the rows out), so 2 ranks of
2 rows train as one process on the global batch of 4. Two steps: the 9 rows leave one for the third
global batch, which even_batches would fill with a repeated row on the other rank."""

from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(os.path.dirname(HERE)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from tests.engine.packing import tiny  # noqa: E402

#: the chunked loss and selective activation checkpointing, which change no value (the 2-process run of both
#: is compared with the 1-process run of neither)
CHUNKED_AND_CHECKPOINTED = {
    "train": {"loss": {"chunked": True, "chunk_size": 7}},
    "activation_checkpointing": {"mode": "selective"},
}


def train(output_dir: str, world: int, stream: bool = False, **extra: Any) -> Any:
    from kiln import Trainer

    cfg = {
        "output_dir": output_dir,
        "seed": 3,
        "learning_rate": 0.1,
        "optim": "sgd",
        "max_grad_norm": 0.0,
        "lr_scheduler_type": "constant",
        "max_steps": 2,
        "per_device_train_batch_size": 4 // world,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": {"name": "ddp" if world > 1 else "single", "device": "cpu"},
        "data": {"packing": {"strategy": "bfd", "max_length": 24}},
        **extra,
    }
    examples = tiny.examples("llama", n=24)
    if stream:
        from tests.engine.packing.test_fit import Stream

        examples = Stream(examples)
    trainer = Trainer(tiny.model("llama"), cfg, train_dataset=examples)
    trainer.fit()
    return trainer
