"""cpu_ram_efficient_loading on every rank, for kiln's TinyLM and a tiny GPT-2 built from a config by
model_init: each is trained twice (normal FSDP, then efficient loading). During model building and
set-up a dispatch-mode counter records the peak number of floating-point elements alive in real
(non-meta) storage. Rank 0 writes OUT/result.json (both ranks' counts) and OUT/weights.safetensors.
Run by worker_many.py (`main(OUT)` on every rank)"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from kiln import Trainer  # noqa: E402
from tests.helpers import padded_token_data  # noqa: E402
from tests.strategies.fsdp import cases  # noqa: E402


class LiveElements(TorchDispatchMode):
    """Peak floating-point elements held in real storage created while active (freed storage is
    pruned through weak references before each new one is counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            t = getattr(t, "_local_tensor", t)
            if not isinstance(t, torch.Tensor) or t.is_meta or not t.is_floating_point():
                continue
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            storage = t.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in self.live:
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes() // t.element_size())
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return result


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def tiny():
    return cases.TinyLM(vocab=64, dim=64)


def gpt2_data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 64, (12,), generator=g)), "labels": ids.clone()} for _ in range(16)]


def run(out, name, build, data, efficient):
    seen = {}

    def model_init():
        with counter:
            model = build()
        seen["meta_before_sharding"] = all(p.is_meta for p in model.parameters())
        seen["elements"] = sum(p.numel() for p in model.parameters())
        return model

    counter = LiveElements()
    strategy = {"name": "fsdp", "device": "cpu", "cpu_ram_efficient_loading": efficient}
    trainer = Trainer(
        model_init=model_init,
        config={
            "output_dir": os.path.join(out, name),
            "seed": 5,
            "learning_rate": 0.01,
            "max_steps": 3,
            "per_device_train_batch_size": 2,
            "save": {"strategy": "no"},
            "log": {"disable_tqdm": True},
            "strategy": strategy,
        },
        train_dataset=data,
    )
    setup_module = trainer.strategy.setup_module

    def counted(module):
        with counter:
            return setup_module(module)

    trainer.strategy.setup_module = counted
    trainer.fit()
    shard = sum(p.to_local().numel() for p in trainer.model.parameters())
    weights = cases.full_weights(trainer)
    head = getattr(trainer.model, "lm_head", None)
    facts = {
        **seen,
        "peak": counter.peak,
        "shard": shard,
        "tied": head is not None and head.weight is trainer.model.transformer.wte.weight,
    }
    return dist.all_gather_object(every := [None] * dist.get_world_size(), facts) or every, weights


def main(out: str) -> None:
    result, tensors = {}, {}
    for name, build, data in (("tiny", tiny, padded_token_data(16, 10, 64, seed=1)), ("gpt2", gpt2, gpt2_data())):
        for efficient in (False, True):
            key = f"{name}_{'efficient' if efficient else 'normal'}"
            result[key], weights = run(out, key, build, data, efficient)
            tensors.update({f"{key}/{k}": v.contiguous() for k, v in weights.items()})
    if dist.get_rank() == 0:
        save_file(tensors, os.path.join(out, "weights.safetensors"))
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(result, fh)
