"""A tied-embedding GPT-2 (built from a small GPT2Config) under FSDP on every rank: trains with
sharded checkpoints, then exports. Rank 0 writes OUT/result.json.
Usage: torchrun --nproc_per_node=N worker_gpt2.py OUT"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from kiln import Trainer  # noqa: E402

out = sys.argv[1]
world = int(os.environ.get("WORLD_SIZE", "1"))


def config() -> GPT2Config:
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True)


def data(n: int = 24) -> list:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 64, (12,), generator=g)), "labels": ids.clone()} for _ in range(n)]


torch.manual_seed(0)
model = GPT2LMHeadModel(config())
trainer = Trainer(
    model,
    {
        "output_dir": os.path.join(out, "run"),
        "seed": 1,
        "learning_rate": 1e-2,
        "max_steps": 4,
        "per_device_train_batch_size": 4 // world,
        "save": {"strategy": "steps", "steps": 2},
        "log": {"disable_tqdm": True},
        "strategy": {"name": "fsdp", "device": "cpu"},
    },
    train_dataset=data(),
)
trainer.fit()
tied = model.lm_head.weight is model.transformer.wte.weight
trainer.save_model(os.path.join(out, "export"))
weights = trainer.strategy.model_state_for_export(model)
if trainer.strategy.is_global_zero:
    save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, os.path.join(out, "live.safetensors"))
    with open(os.path.join(out, "result.json"), "w") as fh:
        json.dump({"tied_after_training": tied, "step": trainer.state.global_step}, fh)

# leave the process group before interpreter shutdown (an abort at exit was seen once, see the report)
import torch.distributed as _dist  # noqa: E402

if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
