"""kiln against transformers.Trainer itself on a tiny GPT-2 built from a config (no downloads): the
logged losses, grad norms and learning rates of a run with gradient accumulation over micro-batches
with different token counts (so per-micro-batch means and the global token mean differ)."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln import Trainer
from tests.helpers import base_config, flat_params

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_positions=12,
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


def _data(n: int = 16, length: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 40, (length,), generator=g)
        labels = ids.clone()
        labels[(2 + 3 * i) % length + 1 :] = -100  # 2..12 real tokens: micro-batches differ a lot
        rows.append({"input_ids": ids, "labels": labels})
    return rows


class _InOrder(transformers.Trainer):
    """HF's Trainer reading the data in order, so both runs see the same micro-batches."""

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


def _hf_run(tmp_path, model, data, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=4,
        learning_rate=1e-2,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **kw,
    )
    trainer = _InOrder(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def _kiln_run(tmp_path, model, data, **kw):
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    cfg = base_config(
        tmp_path, max_steps=4, learning_rate=1e-2, warmup_steps=2, gradient_accumulation_steps=4, logging_steps=1, **kw
    )
    trainer = Trainer(model, cfg, train_dataset=loader)
    trainer.fit()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_gpt2_with_accumulation_matches_hf_trainer(tmp_path, smoothing):
    """num_items_in_batch reaches the **kwargs forward (and the label smoother), so losses and grad norms are
    HF's global token means; learning_rate is the rate each step used ([0, 0.005, 0.01, ...] with warmup)."""
    model, data = _gpt2(), _data()
    theirs_model, ours_model = copy.deepcopy(model), copy.deepcopy(model)
    theirs = _hf_run(tmp_path, theirs_model, data, label_smoothing_factor=smoothing)
    ours = _kiln_run(tmp_path, ours_model, data, label_smoothing_factor=smoothing)
    assert [h["step"] for h in ours] == [h["step"] for h in theirs] == [1, 2, 3, 4]
    assert [h["learning_rate"] for h in ours] == pytest.approx([h["learning_rate"] for h in theirs], abs=1e-12)
    assert ours[0]["learning_rate"] == 0.0 and ours[1]["learning_rate"] == pytest.approx(5e-3)
    assert [h["loss"] for h in ours] == pytest.approx([h["loss"] for h in theirs], rel=1e-5)
    assert [h["grad_norm"] for h in ours] == pytest.approx([h["grad_norm"] for h in theirs], rel=1e-4)
    diff = (flat_params(ours_model) - flat_params(theirs_model)).abs().max().item()
    assert diff < 2e-5, diff  # op order (clipping, fused sums) differs: roundoff only
