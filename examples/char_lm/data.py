"""Character-level language-modelling data from text every Python install has: the `.py` sources of
the standard library, gathered at run time (nothing is downloaded).

`build_data` is the `task.data` callable of `config.yaml`. The file list is sorted, shuffled with
`seed`, capped at `max_chars`, and split into train and eval *by file* (no file contributes to both),
so the same arguments always give the same windows on the same Python version.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from examples.char_lm.sampling import SampleTextCallback

UNK = "\ufffd"  # id 0; also what undecodable bytes become, so both map to the same id
# installed packages, test suites, and generated data that is not code: codec tables (`encodings/`) and
# the 750k characters of quoted help text in `pydoc_data/`
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_sources(root: str) -> list[str]:
    """Sorted relative paths of the `.py` files under `root`, without installed packages, test
    suites and machine-specific files (sysconfig data, build config)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def read_corpus(root: str, max_chars: int, seed: int) -> list[tuple[str, str]]:
    """(path, text) pairs in a seeded random order, until `max_chars` characters (the last file cut)."""
    paths = list_sources(root)
    if not paths:
        raise FileNotFoundError(f"No .py files found under {root!r}.")
    random.Random(seed).shuffle(paths)
    files, total = [], 0
    for path in paths:
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as fh:
            text = fh.read()[: max_chars - total]
        files.append((path, text))
        total += len(text)
        if total >= max_chars:
            break
    return files


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


class CharVocab:
    """Characters by id. Id 0 is the unknown character; rare characters map to it."""

    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = [UNK] + [c for c in chars if c != UNK]
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        # vectorised lookup for encode(): code points sorted, with their ids alongside
        order = sorted(range(1, len(self.chars)), key=lambda i: self.chars[i])
        self._codes = np.array([ord(self.chars[i]) for i in order], dtype=np.uint32)
        self._ids = np.array(order, dtype=np.int64)

    @classmethod
    def from_text(cls, text: str, min_count: int = 1) -> CharVocab:
        codes, counts = np.unique(_code_points(text), return_counts=True)
        return cls([chr(c) for c, n in zip(codes.tolist(), counts.tolist()) if n >= min_count])

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        codes = _code_points(text)
        pos = np.minimum(np.searchsorted(self._codes, codes), max(len(self._codes) - 1, 0))
        known = self._codes[pos] == codes if len(self._codes) else np.zeros(len(codes), dtype=bool)
        return torch.from_numpy(np.where(known, self._ids[pos] if len(self._ids) else 0, 0).astype(np.int64))

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[i] for i in torch.as_tensor(ids).tolist())


class CharWindows(Dataset):
    """Fixed-length windows over one id sequence: `input_ids` = ids[s : s+block], `labels` = the next
    characters ids[s+1 : s+block+1]. Windows start every `stride` characters (default: no overlap).
    `vocab` and `files` (the source paths, in order) are kept for inspection and decoding."""

    def __init__(
        self,
        ids: torch.Tensor,
        block_size: int,
        stride: int | None = None,
        vocab: CharVocab | None = None,
        files: Sequence[str] = (),
    ) -> None:
        self.ids = ids
        self.vocab = vocab
        self.files = list(files)
        self.block_size = block_size
        self.stride = stride or block_size
        usable = len(ids) - block_size - 1
        self.length = usable // self.stride + 1 if usable >= 0 else 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        start = index * self.stride
        chunk = self.ids[start : start + self.block_size + 1].long()
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def char_accuracy(eval_pred: Any) -> dict[str, float]:
    """Next-character accuracy from an EvalPrediction (or a (predictions, labels) tuple), ignoring
    -100 labels. Takes argmax predictions as `validation_step` returns them, or full logits."""
    preds, labels = np.asarray(eval_pred[0]), np.asarray(eval_pred[1])
    if preds.ndim == labels.ndim + 1:
        preds = preds.argmax(-1)
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def split_by_file(files: list[tuple[str, str]], eval_fraction: float) -> tuple[list, list]:
    """(train, eval): eval takes the files, in the given order, that still fit under `eval_fraction`
    of all characters (or the smallest file, if none does); train gets the rest."""
    target, is_eval, n = eval_fraction * sum(len(t) for _, t in files), [False] * len(files), 0
    for i, (_, text) in enumerate(files):
        if n + len(text) <= target:
            is_eval[i], n = True, n + len(text)
    if not any(is_eval):
        is_eval[min(range(len(files)), key=lambda i: len(files[i][1]))] = True
    pairs = list(zip(files, is_eval))
    return [f for f, e in pairs if not e], [f for f, e in pairs if e]


def build_data(
    block_size: int = 128,
    max_chars: int = 3_000_000,
    eval_fraction: float = 0.05,
    seed: int = 0,
    min_char_count: int = 20,
    root: str | None = None,
    sample_prompt: str = "def ",
    sample_chars: int = 400,
    sample_temperature: float = 0.8,
    sample_top_k: int | None = None,
) -> dict[str, Any]:
    """The dict `kiln fit` expects: datasets, metrics, the sampling callback and the vocab size.

    Characters seen fewer than `min_char_count` times in the training text become the unknown id,
    which keeps the vocabulary (and the initial loss, about ln V) small.
    """
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
    files = read_corpus(root or stdlib_dir(), max_chars, seed)
    if len(files) < 2:
        raise ValueError(
            f"max_chars={max_chars} covers a single file; raise it so that train and eval each get files of their own."
        )
    train_files, eval_files = split_by_file(files, eval_fraction)
    vocab = CharVocab.from_text("\n".join(t for _, t in train_files), min_count=min_char_count)

    def windows(split: list[tuple[str, str]]) -> CharWindows:
        ids = vocab.encode("\n".join(t for _, t in split))
        ids = ids.to(torch.uint8 if len(vocab) <= 256 else torch.int32)  # compact; windows come out as int64
        return CharWindows(ids, block_size, vocab=vocab, files=[p for p, _ in split])

    train_dataset, eval_dataset = windows(train_files), windows(eval_files)
    sampler = SampleTextCallback(
        vocab,
        prompt=sample_prompt,
        max_new_tokens=sample_chars,
        temperature=sample_temperature,
        top_k=sample_top_k,
        seed=seed,
    )
    return {
        "train_dataset": train_dataset,
        "eval_dataset": eval_dataset,
        "compute_metrics": char_accuracy,
        "callbacks": [sampler],
        # block_size comes from here so the model always matches the windows (keep it out of task.model_args)
        "model_args": {"vocab_size": len(vocab), "block_size": block_size, "vocab": vocab.chars},
    }
