"""kiln's Trainer next to transformers.Trainer on the same tiny GPT-2 (built from a config, no downloads) and
the same data: the pieces the data-loading parity tests share."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.helpers import base_config, flat_params

VOCAB, LENGTH = 40, 8


def gpt2() -> torch.nn.Module:
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def token_rows(n: int, seed: int = 1) -> dict[str, list[Any]]:
    """Columns of n rows: input_ids / labels as lists of ints, plus columns GPT-2's forward does not take."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    return {
        "input_ids": ids.tolist(),
        "labels": ids.tolist(),
        "idx": list(range(n)),
        "text": [f"row {i}" for i in range(n)],
    }


def hf_args(out: str, **kw: Any) -> Any:
    import transformers

    base = dict(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def kiln_config(tmp_path: Any, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1)
    base.update(kw)
    return base_config(tmp_path, **base)


def twin_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = gpt2()
    return copy.deepcopy(model), copy.deepcopy(model)


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return (flat_params(a) - flat_params(b)).abs().max().item()


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
