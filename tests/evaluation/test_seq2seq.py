"""predict_with_generate with a tiny Transformers encoder-decoder built from a config (no download):
predictions are the ids model.generate returns, right-padded with -100 across batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kiln import EvalPrediction, Trainer, load_config
from kiln.engine.evaluation.generation import generation_kwargs
from kiln.engine.evaluation.nested import concat_padded
from tests.evaluation.common import config

transformers = pytest.importorskip("transformers")

BATCH = 2


@pytest.fixture(scope="module")
def model() -> Any:
    cfg = transformers.BartConfig(
        vocab_size=24,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        decoder_start_token_id=1,
        forced_eos_token_id=None,
        forced_bos_token_id=None,
        init_std=0.5,
        dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(cfg).eval()


@pytest.fixture(scope="module")
def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 24, (8, 6), generator=g)
    labels = torch.randint(3, 24, (8, 5), generator=g)
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(6, dtype=torch.long), "labels": labels[i]} for i in range(8)
    ]


def by_hand(model: Any, rows: list[dict[str, torch.Tensor]], **kwargs: Any) -> list[torch.Tensor]:
    """generate() batch by batch, as the Trainer must call it."""
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), BATCH):
            batch = torch.utils.data.default_collate(rows[start : start + BATCH])
            out.append(model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs))
    return out


#: an end-of-sequence id at which some batches of `rows` stop early with this seed (lengths 2, 2, 2, 4),
#: so sequences differ in length across batches (searching for one costs many slow generate() calls)
EOS = 16


def test_predict_with_generate(tmp_path: Any, model: Any, rows: list[dict[str, torch.Tensor]]) -> None:
    eos = EOS
    generated = by_hand(model, rows, max_length=8, num_beams=2, eos_token_id=eos)
    assert len({g.shape[1] for g in generated}) > 1, "pick another EOS: every batch has the same length"
    expected = concat_padded([g.numpy() for g in generated], -100)
    seen: list[EvalPrediction] = []
    cfg = config(
        tmp_path,
        per_device_eval_batch_size=BATCH,
        predict_with_generate=True,
        generation_max_length=8,
        generation_num_beams=2,
    )
    trainer = Trainer(model, cfg, compute_metrics=lambda p: seen.append(p) or {"rows": len(p.predictions)})
    out = trainer.predict(rows, eos_token_id=eos)  # generate() kwargs of the call reach the model
    np.testing.assert_array_equal(out.predictions, expected)
    np.testing.assert_array_equal(out.label_ids, np.stack([r["labels"].numpy() for r in rows]))
    np.testing.assert_array_equal(seen[0].predictions, expected)
    assert out.metrics["test_rows"] == 8
    with torch.no_grad():  # the loss is still the teacher-forced loss on the labels
        batch = torch.utils.data.default_collate(rows)
        losses = [model(**torch.utils.data.default_collate(rows[i : i + BATCH])).loss for i in range(0, 8, BATCH)]
    assert out.metrics["test_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    assert batch["labels"].shape == (8, 5)


def test_evaluate_with_generate_and_call_kwargs(tmp_path: Any, model: Any, rows: list[dict[str, torch.Tensor]]) -> None:
    cfg = config(tmp_path, per_device_eval_batch_size=BATCH, predict_with_generate=True, generation_max_length=8)
    seen: list[EvalPrediction] = []
    rows = rows[:4]
    trainer = Trainer(model, cfg, eval_dataset=rows, compute_metrics=lambda p: seen.append(p) or {})
    metrics = trainer.evaluate(max_new_tokens=3)  # a length in the call replaces generation_max_length
    want = concat_padded([g.numpy() for g in by_hand(model, rows, max_new_tokens=3)], -100)
    np.testing.assert_array_equal(seen[0].predictions, want)
    assert seen[0].predictions.shape[1] == 4  # decoder start + 3 new tokens
    assert "eval_loss" in metrics

    # without compute_metrics evaluate() only needs the loss: nothing is generated (HF)
    calls = []
    original = model.generate
    model.generate = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        assert "eval_loss" in Trainer(model, cfg, eval_dataset=rows).evaluate()
    finally:
        del model.generate
    assert not calls


def test_generation_kwargs_precedence(tmp_path: Any) -> None:
    e = load_config(
        {
            "output_dir": str(tmp_path),
            "generation_max_length": 20,
            "generation_num_beams": 4,
            "eval": {"generation_kwargs": {"max_new_tokens": 5, "do_sample": False, "num_beams": 2}},
        }
    ).eval
    assert generation_kwargs(e, {}) == {"max_length": 20, "num_beams": 4, "do_sample": False}
    assert generation_kwargs(e, {"max_new_tokens": 3, "num_beams": 1}) == {
        "max_new_tokens": 3,
        "num_beams": 1,
        "do_sample": False,
    }
    assert generation_kwargs(e, {"max_length": None}) == {"max_length": 20, "num_beams": 4, "do_sample": False}
    plain = load_config({"output_dir": str(tmp_path)}).eval
    assert generation_kwargs(plain, {}) == {}  # the model's generation_config decides


def test_generate_without_labels_needs_no_forward(tmp_path: Any) -> None:
    """T5's forward fails without decoder inputs: unlabeled data must only be generated from."""
    cfg = transformers.T5Config(
        vocab_size=24,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        dropout_rate=0.0,
    )
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(cfg).eval()
    rows = [{"input_ids": torch.arange(3, 9) + i, "attention_mask": torch.ones(6, dtype=torch.long)} for i in range(4)]
    out = Trainer(
        t5, config(tmp_path, per_device_eval_batch_size=BATCH, predict_with_generate=True, generation_max_length=4)
    ).predict(rows)
    assert out.label_ids is None and "test_loss" not in out.metrics
    np.testing.assert_array_equal(
        out.predictions, concat_padded([g.numpy() for g in by_hand(t5, rows, max_length=4)], -100)
    )
