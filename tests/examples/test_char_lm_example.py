"""examples/char_lm: deterministic data, the TrainingModule contract, sampling, and that it learns."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from examples.char_lm.data import SKIP_DIRS, UNK, CharVocab, build_data, char_accuracy, list_sources, stdlib_dir
from examples.char_lm.model import CharGPT
from examples.char_lm.sampling import SampleTextCallback
from kiln import EvalPrediction

SMALL = {"block_size": 32, "max_chars": 200_000, "eval_fraction": 0.1, "min_char_count": 2}


@pytest.fixture(scope="module")
def data() -> dict:
    return build_data(seed=0, **SMALL)


def tiny_model(data: dict, **kw) -> CharGPT:
    torch.manual_seed(0)
    args = {"n_layer": 1, "n_head": 2, "n_embd": 32, **data["model_args"]}
    args.update(kw)
    return CharGPT(**args)


def batch_of(dataset, n: int) -> dict:
    return torch.utils.data.default_collate([dataset[i] for i in range(n)])


def test_sources_skip_installed_packages_and_tests() -> None:
    paths = list_sources(stdlib_dir())
    assert paths == sorted(paths) and len(paths) > 100
    assert all(p.endswith(".py") for p in paths)
    assert not [p for p in paths if set(p.split(os.sep)[:-1]) & SKIP_DIRS]


def test_build_data_is_deterministic(data: dict) -> None:
    again = build_data(seed=0, **SMALL)
    for split in ("train_dataset", "eval_dataset"):
        assert torch.equal(data[split].ids, again[split].ids)
        assert data[split].files == again[split].files
    assert data["train_dataset"].vocab.chars == again["train_dataset"].vocab.chars
    other = build_data(seed=1, **SMALL)
    assert other["eval_dataset"].files != data["eval_dataset"].files


def test_split_is_by_file_and_windows_are_shifted(data: dict) -> None:
    train, evals = data["train_dataset"], data["eval_dataset"]
    assert not set(train.files) & set(evals.files)
    total = len(train.ids) + len(evals.ids)
    assert 0.05 <= len(evals.ids) / total <= 0.1
    assert len(train) == (len(train.ids) - 33) // 32 + 1
    item = train[len(train) - 1]
    assert set(item) == {"input_ids", "labels"}
    assert item["input_ids"].shape == item["labels"].shape == (32,)
    assert item["input_ids"].dtype == item["labels"].dtype == torch.long
    assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
    with pytest.raises(IndexError):
        train[len(train)]


def test_vocab(data: dict) -> None:
    vocab = data["train_dataset"].vocab
    assert data["model_args"]["vocab_size"] == len(vocab) == len(data["model_args"]["vocab"])
    assert vocab.chars[0] == UNK and len(set(vocab.chars)) == len(vocab)
    assert int(data["train_dataset"].ids.max()) < len(vocab)
    text = "def f(x):\n    return x\n"
    assert vocab.decode(vocab.encode(text)) == text
    assert vocab.encode("\u2603").tolist() == [0]  # a character the stdlib never uses

    rare = CharVocab.from_text("aaab", min_count=2)
    assert rare.chars == [UNK, "a"] and rare.encode("abc").tolist() == [1, 0, 0]


def test_steps_follow_the_module_contract(data: dict) -> None:
    model = tiny_model(data)
    batch = batch_of(data["train_dataset"], 4)
    loss = model.training_step(batch)
    assert loss.dim() == 0 and abs(loss.item() - math.log(len(data["train_dataset"].vocab))) < 0.5
    assert int(model.num_items(batch)) == 4 * 32

    out = model.validation_step(batch)
    assert set(out) == {"loss", "predictions", "labels"}
    assert out["predictions"].shape == out["labels"].shape == (4, 32)
    assert out["predictions"].dtype == torch.long
    assert torch.allclose(out["loss"], loss)

    # Ignored targets are neither counted nor averaged over.
    batch["labels"][:, :16] = -100
    assert int(model.num_items(batch)) == 4 * 16
    logits = model(batch["input_ids"])[:, 16:]
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 16:].flatten())
    assert torch.allclose(model.training_step(batch), expected)


def test_generate_returns_requested_length(data: dict) -> None:
    model = tiny_model(data)
    model.train()
    ids = model.generate(torch.tensor([1, 2, 3]), max_new_tokens=12, temperature=1.0, top_k=5)
    assert ids.shape == (15,) and torch.equal(ids[:3], torch.tensor([1, 2, 3]))
    assert model.training  # restored
    batch = model.generate(torch.zeros(2, 40, dtype=torch.long), max_new_tokens=5)  # longer than block_size
    assert batch.shape == (2, 45)
    text = model.generate("import ", max_new_tokens=10)
    assert isinstance(text, str) and len(text) == 17 and text.startswith("import ")
    same_seed = [model.generate("x", 8, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert same_seed[0] == same_seed[1]
    assert model.generate("x", 8, temperature=0) == model.generate("x", 8, temperature=0)
    with pytest.raises(ValueError, match="without `vocab`"):
        CharGPT(vocab_size=10, n_layer=1, n_head=2, n_embd=16).generate("x", 1)


def test_loss_decreases_in_a_plain_loop(data: dict) -> None:
    model = tiny_model(data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(
        data["train_dataset"], batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    losses = []
    for _, batch in zip(range(20), loader):
        loss = model.training_step(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses


def test_sample_callback_prints_on_the_main_process_only(data: dict, capsys: pytest.CaptureFixture) -> None:
    """Every rank samples (under FSDP each forward is a collective), the same text; rank 0 alone prints."""
    model = tiny_model(data)
    cb = SampleTextCallback(data["train_dataset"].vocab, prompt="class ", max_new_tokens=30)
    wrapped = SimpleNamespace(module=model)  # as a DDP wrapper would hand it over
    cb.on_train_end(None, SimpleNamespace(is_world_process_zero=False, global_step=7), None, model=wrapped)
    other = cb.last_sample
    assert capsys.readouterr().out == "" and len(other) == 36
    cb.on_train_end(None, SimpleNamespace(is_world_process_zero=True, global_step=7), None, model=wrapped)
    out = capsys.readouterr().out
    assert "after 7 steps" in out and cb.last_sample == other and cb.last_sample in out
    assert [type(c) for c in data["callbacks"]] == [SampleTextCallback]


def test_char_accuracy_ignores_padding() -> None:
    preds = np.array([[1, 2, 3, 4]])
    labels = np.array([[1, 0, 3, -100]])
    assert char_accuracy(EvalPrediction(preds, labels)) == {"accuracy": pytest.approx(2 / 3)}
    logits = np.eye(5)[preds]  # logits are reduced by argmax
    assert char_accuracy((logits, labels)) == {"accuracy": pytest.approx(2 / 3)}
