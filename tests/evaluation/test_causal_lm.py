"""Causal LMs from Transformers evaluate as under `transformers.Trainer` (issue 30, items 12a/12b):
the KV cache the model returns is left out of the predictions (HF's ignore_keys default), and
`eval_loss` is HF's number on the same weights and data, a short last batch included."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from kiln import Trainer

transformers = pytest.importorskip("transformers")


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def _llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _rows(n: int = 10, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Token rows whose labels mask a different number of leading positions, so that each batch's
    mean loss covers a different number of tokens."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 64, (length,), generator=g)
        labels = ids.clone()
        labels[: (i % 5) * 2] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _token_accuracy(pred: Any) -> dict[str, float]:
    logits, labels = pred
    assert isinstance(logits, np.ndarray), f"predictions must be the logits alone, got {type(logits).__name__}"
    hits = logits[:, :-1].argmax(-1) == labels[:, 1:]
    return {"token_accuracy": float(hits[labels[:, 1:] != -100].mean())}


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_causal_lm_evaluates_during_training_with_compute_metrics(build: Any, tmp_path: Any) -> None:
    model = build()
    model.config.use_cache = True  # the model returns its KV cache (a DynamicCache) from every forward
    rows = _rows()
    trainer = Trainer(
        model,
        {
            "output_dir": str(tmp_path),
            "max_steps": 2,
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 4,
            "eval_strategy": "steps",
            "eval_steps": 1,
            "report_to": "none",
            "disable_tqdm": True,
        },
        train_dataset=rows,
        eval_dataset=rows,
        compute_metrics=_token_accuracy,
    )
    trainer.train()
    evals = [row for row in trainer.state.log_history if "eval_loss" in row]
    assert [row["step"] for row in evals] == [1, 2]
    assert all(0 <= row["eval_token_accuracy"] <= 1 for row in evals)
    out = trainer.predict(rows)
    assert isinstance(out.predictions, np.ndarray) and out.predictions.shape == (10, 16, 64)


def test_explicit_ignore_keys_replace_the_default(tmp_path: Any) -> None:
    """ignore_keys=[] keeps every output, as in HF: the cache is then the caller's to deal with."""
    model = _gpt2()
    model.config.use_cache = True
    trainer = Trainer(
        model,
        {"output_dir": str(tmp_path), "per_device_eval_batch_size": 4, "report_to": "none"},
        compute_metrics=lambda p: {},
    )
    with pytest.raises(TypeError, match="Cache"):
        trainer.evaluate(_rows(), ignore_keys=[])


def _hf_eval_loss(model: Any, rows: list[dict[str, torch.Tensor]], out: str) -> float:
    args = transformers.TrainingArguments(out, per_device_eval_batch_size=4, report_to="none", use_cpu=True)
    return transformers.Trainer(model, args, eval_dataset=rows).evaluate()["eval_loss"]


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_eval_loss_is_hf_eval_loss_on_the_same_weights(build: Any, tmp_path: Any) -> None:
    """10 samples in batches of 4: the last batch is short, and the labels mask a different number of
    tokens per row. HF weighs each batch's mean loss by the batch's samples and has the model divide
    its summed loss by the batch's label count (`num_items_in_batch`)."""
    model, rows = build(), _rows()
    hf_model = copy.deepcopy(model)
    kiln = Trainer(
        model, {"output_dir": str(tmp_path / "kiln"), "per_device_eval_batch_size": 4, "report_to": "none"}
    ).evaluate(rows)["eval_loss"]
    hf = _hf_eval_loss(hf_model, rows, str(tmp_path / "hf"))
    assert kiln == pytest.approx(hf, abs=1e-6)


def test_two_ranks_gather_the_logits_without_the_cache(tmp_path: Any) -> None:
    """The same rule on every rank of a (simulated, threaded) two-rank world: predictions are the
    single-process ones, in dataset order."""
    from kiln import load_config
    from tests.evaluation.test_simulated_world import SimulatedRank, World

    rows, world = _rows(), World(2)
    single = (
        Trainer(_gpt2(), {"output_dir": str(tmp_path / "one"), "per_device_eval_batch_size": 2, "report_to": "none"})
        .predict(rows)
        .predictions
    )
    ranks = []
    for rank in range(2):
        cfg = {"output_dir": str(tmp_path / str(rank)), "per_device_eval_batch_size": 2, "report_to": "none"}
        model = _gpt2()
        model.config.use_cache = True
        ranks.append(Trainer(model, cfg, strategy=SimulatedRank(load_config(cfg), None, world, rank)))
    outputs = world.run(lambda rank: ranks[rank].predict(rows))
    for out in outputs:
        np.testing.assert_allclose(out.predictions, single, rtol=1e-5, atol=1e-6)
