"""NEFTune (`neftune_noise_alpha`): uniform noise of size alpha / sqrt(seq_len x hidden) on the input
embeddings during training only; the hook is gone after fit(); a model without input embeddings
gets a clear error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kiln import Trainer
from kiln.config.load import ConfigError, load_config
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, TokenModel, base_config, padded_token_data

ALPHA = 5.0


class RecordingLM(TokenModel):
    """Keeps what its embedding layer returned (after any hooks) next to the clean lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, torch.Tensor, torch.Tensor]] = []

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.emb

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.emb(ids)
        self.seen.append((self.training, out.detach().clone(), F.embedding(ids, self.emb.weight).detach().clone()))
        return out

    def training_step(self, batch):
        logits = self.head(self._embed(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def test_noise_is_bounded_uniform_and_only_in_training(tmp_path):
    data = padded_token_data(n=16, length=12)
    model = RecordingLM()
    cfg = base_config(
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=4,
        neftune_noise_alpha=ALPHA,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
    )
    Trainer(model, cfg, train_dataset=data, eval_dataset=data[:4]).fit()
    bound = ALPHA / math.sqrt(12 * model.emb.embedding_dim)
    train = [(out - clean) for training, out, clean in model.seen if training]
    assert len(train) == 4
    noise = torch.cat([n.flatten() for n in train])
    assert noise.abs().max() <= bound * (1 + 1e-6)
    assert noise.abs().max() > 0.9 * bound and abs(float(noise.mean())) < 0.1 * bound  # spread over the whole range
    evaluated = [(out, clean) for training, out, clean in model.seen if not training]
    assert len(evaluated) == 2 and all(torch.equal(out, clean) for out, clean in evaluated)  # evaluation: no noise
    assert not model.emb._forward_hooks  # removed after fit: later calls and the saved model are clean


def test_without_alpha_embeddings_are_untouched(tmp_path):
    model = RecordingLM()
    Trainer(
        model, base_config(tmp_path, max_steps=2, per_device_train_batch_size=4), train_dataset=padded_token_data(n=8)
    ).fit()
    assert model.seen and all(torch.equal(out, clean) for _, out, clean in model.seen)


def test_a_model_without_input_embeddings_gets_a_clear_error(tmp_path):
    trainer = Trainer(
        TinyRegressor(),
        base_config(tmp_path, max_steps=1, neftune_noise_alpha=ALPHA),
        train_dataset=[{"x": torch.randn(8), "y": torch.tensor(0.0)}] * 4,
    )
    with pytest.raises(KilnError, match="neftune_noise_alpha needs the input embeddings of TinyRegressor"):
        trainer.fit()


def test_alpha_must_be_positive():
    with pytest.raises(ConfigError, match="train.neftune_noise_alpha"):
        load_config({"neftune_noise_alpha": -1.0})
