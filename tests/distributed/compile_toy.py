"""Shared by the compile tests (one process) and worker_compile.py (2 processes): a counting
torch.compile backend, the tiny models, and the hand-written compiled loops kiln is held to.

The rule: over the same shapes, in the same order (train windows, then evaluation, per epoch),
kiln compiles as many graphs and breaks as many times as these loops do."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from kiln import Callback  # noqa: E402

BACKEND = "kiln_test_count"  # aot_eager (forward and backward graphs through AOT autograd), counted


class _Counter:
    graphs = 0  # backend calls: every graph dynamo hands over, recompiles included


COUNT = _Counter()


def _counting(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    COUNT.graphs += 1
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


if BACKEND not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(_counting, name=BACKEND)


def reset() -> None:
    """A fresh dynamo (no cached graphs, zero counters) before each run that is counted."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    COUNT.graphs = 0


def counts() -> dict[str, int]:
    """Graphs compiled (with recompiles), distinct graphs dynamo captured, and graph breaks."""
    counters = torch._dynamo.utils.counters
    return {
        "graphs": COUNT.graphs,
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": int(sum(counters["graph_break"].values())),
    }


class CountsPerStep(Callback):
    """Graphs compiled so far, at each optimizer step and after each evaluation."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.evals: list[int] = []

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.append(COUNT.graphs)

    def on_evaluate(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.evals.append(COUNT.graphs)


# ----------------------------------------------------------------------------- models and data

SEQ = 16


def gpt2(n_layer: int = 1, *, name_loss: bool = True) -> nn.Module:
    """A tiny GPT-2 without dropout. `name_loss`: its loss_type named, as Transformers 5 cannot derive it
    from the class name GPT2LMHeadModel; unnamed, every forward calls `logger.warning_once` to say so,
    which dynamo cannot trace (a graph break in the model's own code, 8 over these runs)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_positions=32,
            n_layer=n_layer,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
    )
    if name_loss:
        model.loss_type = "ForCausalLM"
    return model


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class BlockLM(nn.Module):
    """A tiny token model with two FSDP blocks (`_no_split_modules`) and HF's contract, much faster
    to trace than GPT-2 (the 2-process tests run it; GPT-2 there is `-m heavy`)."""

    _no_split_modules = ["Block"]

    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.emb(input_ids)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def block_lm(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return BlockLM(layers=layers)


def token_data(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Fixed-length rows whose labelled tokens vary (the rest -100): every window's item count differs
    while the shapes repeat, so a count handed to the forward as a Python number would recompile."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (SEQ,), generator=g)
        labels = ids.clone()
        labels[int(torch.randint(4, SEQ + 1, (1,), generator=g)) :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


class MLP(nn.Module):
    """A tiny regression MLP with Hugging Face's contract: forward(x, labels) -> {"loss", "logits"}."""

    def __init__(self, d_in: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pred = self.net(x).squeeze(-1)
        return {"loss": F.mse_loss(pred, labels), "logits": pred}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def regression_data(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


# ----------------------------------------------------------------------------- hand-written loops


def batches(data: list[dict], size: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive batches of `size` (the last one short), collated as kiln's default collator does."""
    from torch.utils.data import default_collate

    return [default_collate(data[i : i + size]) for i in range(0, len(data), size)]


def windows(micro: list[Any], accumulation: int) -> list[list[Any]]:
    return [micro[i : i + accumulation] for i in range(0, len(micro), accumulation)]


def lm_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What HF passes as num_items_in_batch for a causal LM: the shifted labels that count."""
    return batch["labels"][..., 1:].ne(-100).sum()


def hand_loop(
    compiled: nn.Module,
    optimizer: torch.optim.Optimizer,
    train: list[list[dict]],
    evaluation: list[dict],
    *,
    epochs: int,
    counts_items: bool,
    no_sync: Callable[[], Any] | None = None,
    on_epoch: Callable[[], None] | None = None,
) -> None:
    """The loop a user writes around `torch.compile(model)`: per epoch, every accumulation window
    (forward, backward; `no_sync` inside a window under DDP), the step; then an evaluation in eval
    mode without gradients. A causal LM gets the window's item count as a tensor (HF's
    num_items_in_batch), as HF Trainer passes it."""
    import contextlib

    for _ in range(epochs):
        compiled.train()
        for window in train:
            total = torch.stack([lm_items(b) for b in window]).sum() if counts_items else None
            for i, batch in enumerate(window):
                last = i == len(window) - 1
                with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                    kwargs = {"num_items_in_batch": total} if counts_items else {}
                    loss = compiled(**batch, **kwargs)["loss"]
                    (loss if counts_items else loss / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        compiled.eval()
        with torch.no_grad():
            for batch in evaluation:
                kwargs = {"num_items_in_batch": lm_items(batch)} if counts_items else {}
                compiled(**batch, **kwargs)
        if on_epoch is not None:
            on_epoch()


def kiln_config(
    out: str, *, epochs: int = 2, batch: int, eval_batch: int, accumulation: int = 2, **overrides: Any
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": out,
        "seed": 3,
        "learning_rate": 1e-2,
        "num_train_epochs": epochs,
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": eval_batch,
        "gradient_accumulation_steps": accumulation,
        "eval_strategy": "epoch",
        "torch_compile_backend": BACKEND,
        "log": {"history": [], "disable_tqdm": True, "steps": 1000, "level": "error"},
        "save": {"strategy": "no"},
    }
    cfg.update(overrides)
    return cfg


def flat(params: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in params])
