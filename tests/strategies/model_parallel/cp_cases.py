"""Context-parallel runs shared by the workers (every rank) and the tests (the parent).

On CPU torch has no ring attention, so the model here has none: `TokenLocalLM` is an embedding (with
position embeddings, so a chunk's position_ids matter), an MLP block and a head -- every token's
output depends on that token alone, so splitting the sequence over cp ranks changes no number, and
a cp run must equal `single` with the same global batch. Its loss is a causal LM loss with shifted
labels (`shift_labels` when the batch has them, as Transformers' loss reads them), on padded rows
whose real lengths vary (labels -100 after them), so the cp chunks hold different numbers of items:
the loss weights and item counts must add up over the cp ranks, not average their chunk means.

`run_case(name, root)` trains 4 steps (accumulation 2, clipping) with the global batch 4; the
results record the logged losses, grad norms, eval loss, every micro-batch's num_items_in_batch,
num_input_tokens_seen and the strategy's sizes. `llama_*` cases are the tiny SDPA Llama on CUDA."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln import TrainingModule
from tests.helpers import padded_token_data
from tests.strategies.model_parallel import cases
from tests.strategies.model_parallel.cases import EVERY_2, MP, SINGLE

VOCAB, LENGTH = 64, 8

#: TokenLocalLM's MLP split over tp (its only layers with a natural tensor-parallel pair)
TOKEN_PLAN = {"mlp.1": "colwise", "mlp.3": "rowwise"}

#: rows of up to 22 tokens: not a multiple of 4, so some batches are padded for the split; 65 examples
#: make 32 rows, 4 whole steps of 8, so every data-shard count deals the same rows to each step
PACKED = {"packing": {"strategy": "bfd", "max_length": 22}}

#: name -> (config entries beside the common ones, data shards)
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "cp_single": (SINGLE, 1),
    "cp2": ({"strategy": {**MP, "mesh": {"cp": 2}}, **EVERY_2}, 1),  # load balanced: pieces 0+3 and 1+2
    "cp2_contiguous": ({"strategy": {**MP, "mesh": {"cp": 2}, "cp_load_balance": False}}, 1),
    "cp2_bf16": ({"strategy": {**MP, "mesh": {"cp": 2}}, "bf16": True, "optim": "sgd", "learning_rate": 0.5}, 1),
    "cp_single_bf16": ({**SINGLE, "bf16": True, "optim": "sgd", "learning_rate": 0.5}, 1),
    "dp2cp2": ({"strategy": {**MP, "mesh": {"dp_shard": 2, "cp": 2}}}, 2),
    "cp_one": ({"strategy": {**MP, "mesh": {"dp_shard": 1}}}, 1),
    "cp2tp2": (
        {"strategy": {**MP, "mesh": {"cp": 2, "tp": 2}, "tp_plan": TOKEN_PLAN}},
        1,
    ),  # resumes a cp checkpoint on one process
    # data.packing: a tiny SDPA Llama on packed rows (tests.engine.packing.tiny), cp with gathered keys/values
    "packed_single": ({**SINGLE, "data": PACKED}, 1),
    "packed_cp2": ({"strategy": {**MP, "mesh": {"cp": 2}}, "data": PACKED}, 1),
    "packed_cp2_contiguous": ({"strategy": {**MP, "mesh": {"cp": 2}, "cp_load_balance": False}, "data": PACKED}, 1),
    "packed_dp2cp2": ({"strategy": {**MP, "mesh": {"dp_shard": 2, "cp": 2}}, "data": PACKED}, 2),
    "llama_single_cuda": ({"strategy": {"name": "single", "device": "cuda"}}, 1),
    "llama_cp2_cuda": ({"strategy": {**MP, "device": "cuda", "mesh": {"cp": 2}}}, 1),
}


def handles(name: str) -> bool:
    return cases.resumed(name)[0] in CASES


class TokenLocalLM(TrainingModule):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.position = nn.Embedding(LENGTH, hidden)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 64), nn.GELU(), nn.Linear(64, hidden))
        self.head = nn.Linear(hidden, VOCAB)

    def logits(self, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        h = self.embed(ids) + self.position(positions)
        return self.head(h + self.mlp(h))

    @staticmethod
    def targets(batch: dict) -> torch.Tensor:
        shifted = batch.get("shift_labels")
        return shifted if shifted is not None else F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]

    def training_step(self, batch: dict) -> torch.Tensor:
        targets = self.targets(batch)
        total = F.cross_entropy(
            self.logits(batch).flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        return total / targets.ne(-100).sum().clamp(min=1)  # a chunk without targets: 0 (kiln weighs it 0)

    def num_items(self, batch: dict) -> torch.Tensor:
        return self.targets(batch).ne(-100).sum()


def data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return padded_token_data(n, length=LENGTH, vocab=VOCAB, seed=seed)


def config(name: str, root: str, **extra: Any) -> dict[str, Any]:
    return cases.config(name, root, table=CASES, **{"include_num_input_tokens_seen": True, **extra})


def _counting_trainer() -> Any:
    from kiln import Trainer

    class CountingTrainer(Trainer):
        """Records every micro-batch's num_items_in_batch (the global window's item count)."""

        items: list[float] = []

        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            self.items.append(float(num_items_in_batch))
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    return CountingTrainer


def llama_sdpa() -> Any:
    from transformers import LlamaForCausalLM

    config = cases.llama_config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def run_case(name: str, root: str, **extra: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if name.startswith("packed"):
        from tests.engine.packing import tiny

        model, train, evaluation = tiny.model("llama"), tiny.examples("llama", n=65), tiny.examples("llama", n=4)
    else:
        model = llama_sdpa() if name.startswith("llama") else TokenLocalLM()
        train, evaluation = data(32, seed=1), data(8, seed=2)
    trainer = _counting_trainer()(model, config(name, root, **extra), train_dataset=train, eval_dataset=evaluation)
    trainer.items = []
    trainer.fit()
    metrics = trainer.evaluate()
    hist, s = trainer.state.log_history, trainer.strategy
    result = {
        "losses": [h["loss"] for h in hist if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in hist if "grad_norm" in h],
        "eval_loss": metrics["eval_loss"],
        "items": trainer.items,
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "steps": trainer.state.global_step,
        "data_shards": s.data_shards,
        "item_shards": s.item_shards,
        "grad_divisor": s.grad_divisor,
    }
    return result, cases.full_weights(trainer)
