"""A tiny Llama (hidden 32, 4 layers, vocab 128, from a config), its data and the runs the pipeline
tests compare: `train(out, strategy, ...)` trains it with one global batch on any strategy and returns
the per-step logged losses and the final weights this rank holds (under pp: its stages'); `ragged` and
`LeftPadding` give it batches whose lengths differ, left-padded with an attention mask."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.helpers import padded_token_data  # noqa: E402

VOCAB = 128


def llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def data(n: int = 22) -> list[dict[str, torch.Tensor]]:
    """Sequences with 1..10 real tokens (the rest -100): micro-batches of one window differ in items."""
    return padded_token_data(n, length=10, vocab=VOCAB, seed=3)


def ragged(n: int = 22) -> list[dict[str, torch.Tensor]]:
    """Unpadded sequences of 2..10 tokens (labels are the ids: the model shifts them): `LeftPadding`
    pads each micro-batch to its own longest, so the micro-batches of one window differ in length."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (int(torch.randint(2, 11, (1,), generator=g)),), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


class LeftPadding:
    """A decoder tokenizer's padding_side="left": each micro-batch padded on the left to its longest
    sequence (ids 0, attention_mask 0, labels -100), so the real tokens would attend to the padding but
    for the mask, which the loss then depends on. `lengths`: the length of each micro-batch it made."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        self.lengths.append(length)
        pad = {"input_ids": 0, "attention_mask": 0, "labels": -100}
        return {
            key: torch.stack([torch.cat([f[key].new_full((length - len(f[key]),), value), f[key]]) for f in features])
            for key, value in pad.items()
        }


def config(out: str, strategy: Any, **extra: Any) -> dict[str, Any]:
    """Micro-batches of 3, windows of 2: 22 samples are 8 micro-batches (the last of 1), so 4 steps an
    epoch; SGD with momentum (optimizer state to resume), so that the comparison sees the gradients and
    not AdamW's magnified float noise."""
    cfg: dict[str, Any] = {
        "output_dir": out,
        "seed": 7,
        "learning_rate": 0.5,
        "optim": {"name": "sgd", "optim_args": "momentum=0.9"},
        "num_train_epochs": 1,
        "per_device_train_batch_size": 3,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.3,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": strategy,
    }
    cfg.update(extra)
    return cfg


def train(
    out: str,
    strategy: Any,
    *,
    teardown: bool = True,
    resume: str | None = None,
    eval_dataset: Any = None,
    train_dataset: Any = None,
    data_collator: Any = None,
    **extra: Any,
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    from kiln import Trainer

    model = llama(seed=1 if resume else 0)  # a resumed run's weights come from the checkpoint
    trainer = Trainer(
        model,
        config(out, strategy, **extra),
        train_dataset=data() if train_dataset is None else train_dataset,
        eval_dataset=eval_dataset,
        data_collator=data_collator,
    )
    trainer.fit(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if teardown:
        trainer.teardown()
    return losses, state, trainer


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """The same names, and every tensor within 1e-5 of the one it is compared with."""
    assert sorted(got) == sorted(want), what
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=f"{what}: {name} differs")
