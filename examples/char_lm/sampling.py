"""A callback that shows what the language model learned: a sample of generated text at the end of
training, printed once (on the main process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.engine.callbacks.base import Callback

if TYPE_CHECKING:
    from examples.char_lm.data import CharVocab


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a strategy wrapper (DDP/FSDP `.module`, torch.compile `._orig_mod`)."""
    while not hasattr(model, "generate"):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            break
        model = inner
    return model


class SampleTextCallback(Callback):
    """Prints `max_new_tokens` characters generated after `prompt` when training ends.

    The callback owns the vocabulary, so it works with any model whose `generate(ids, ...)` takes and
    returns id tensors. Sampling uses its own seeded generator: it does not touch the global RNG, so
    adding this callback never changes a run's numbers.
    """

    def __init__(
        self,
        vocab: CharVocab,
        prompt: str = "def ",
        max_new_tokens: int = 400,
        temperature: float = 0.8,
        top_k: int | None = None,
        seed: int = 0,
    ) -> None:
        self.vocab = vocab
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.last_sample: str | None = None

    def sample(self, model: nn.Module) -> str:
        model = unwrap(model)
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(self.seed)
        ids = model.generate(
            self.vocab.encode(self.prompt),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            generator=generator,
        )
        return self.vocab.decode(ids.cpu())

    def on_train_end(self, config: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        if model is None:
            return
        # every rank samples (the same text, from the same seed): under FSDP each forward is a collective
        self.last_sample = self.sample(model)
        if not state.is_world_process_zero:
            return
        rule = "-" * 72
        print(
            f"\n{rule}\nSample after {state.global_step} steps (prompt {self.prompt!r}):\n{rule}\n"
            f"{self.last_sample}\n{rule}",
            flush=True,
        )
