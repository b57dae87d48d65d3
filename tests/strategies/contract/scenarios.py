"""The strategy contract: what every strategy must do with the same numbers as `single`, or refuse
before it starts (a CapabilityError from the Trainer's constructor, matching its capabilities).

`run_all(strategy, root, world)` runs every scenario and returns plain results and tensors; the
1-process strategies run it in the test process, the multi-process ones in `worker.py` on each rank.
The global batch is the same for every world size (the per-device batch scales as 2 / world), and
evaluation runs one sample per batch: the eval loss is a mean of batch means (as in HF), which
depends on how the ranks' shards cut the batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln import TrainingModule
from kiln.strategies import STRATEGIES
from kiln.utils.errors import CapabilityError
from tests.helpers import padded_token_data

STRATEGIES.add_lazy("two_d", "tests.strategies.plugins.two_d")  # the plug-in strategy: its only registry line
STRATEGIES.add_lazy("model_parallel_tp", "tests.strategies.model_parallel.contract_tp")  # tp over every rank

SCENARIOS = ("fit", "evaluate", "predict", "resume", "export", "auto_batch_size", "full_eval")
STEPS = 6


class ContractNet(TrainingModule):
    """Token-level loss over padded sequences, so micro-batches and ranks hold different item counts."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def logits(self, batch: dict) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(batch["input_ids"]))))

    def training_step(self, batch: dict) -> torch.Tensor:
        return F.cross_entropy(self.logits(batch).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def validation_step(self, batch: dict) -> dict:
        logits = self.logits(batch)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits, "labels": batch["labels"]}


def token_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return padded_token_data(n, length=10, seed=seed)


def config(root: str, name: str, world: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": os.path.join(root, name),
        "seed": 5,
        "learning_rate": 0.05,
        "max_steps": STEPS,
        "per_device_train_batch_size": 4 // world,
        "per_device_eval_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.5,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": {"device": "cpu"},
    }
    cfg.update(extra)
    return cfg


class Refused(Exception):
    """The Trainer's constructor refused the combination (a CapabilityError before anything ran)."""


def trainer_for(strategy: Any, root: str, name: str, world: int, **extra: Any) -> Any:
    from kiln import Trainer

    torch.manual_seed(0)
    model = ContractNet()
    try:
        return Trainer(
            model,
            config(root, name, world, **extra),
            train_dataset=token_data(40, seed=1),
            eval_dataset=token_data(7, seed=2),
            strategy=strategy,
        )
    except CapabilityError as err:  # only here: a refusal later than construction is a failure
        raise Refused(str(err)) from None


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    """The full weights through the strategy (sharded strategies gather them), on CPU."""
    state = trainer.strategy.model_state_for_export(trainer.model)
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def _fit(strategy: Any, root: str, world: int) -> tuple[dict, dict]:
    trainer = trainer_for(strategy, root, "fit", world)
    out = trainer.fit()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "train_loss": out.training_loss,
        "steps": out.global_step,
    }, full_weights(trainer)


def _evaluate(strategy: Any, root: str, world: int) -> tuple[dict, dict]:
    trainer = trainer_for(strategy, root, "evaluate", world)
    before = trainer.evaluate()["eval_loss"]  # before training: set up without an optimizer
    trainer.fit()
    return {"before": before, "after": trainer.evaluate()["eval_loss"]}, {}


def _predict(strategy: Any, root: str, world: int) -> tuple[dict, dict]:
    trainer = trainer_for(strategy, root, "predict", world)
    trainer.fit()
    out = trainer.predict(token_data(7, seed=2))
    return {"test_loss": out.metrics["test_loss"]}, {
        "predictions": torch.as_tensor(out.predictions),
        "label_ids": torch.as_tensor(out.label_ids),
    }


def _resume(strategy: Any, root: str, world: int) -> tuple[dict, dict]:
    save = {"save": {"strategy": "steps", "steps": 2}}
    trainer_for(strategy, root, "resume", world, **save).fit()
    resumed = trainer_for(
        strategy, root, "resume", world, resume_from_checkpoint=os.path.join(root, "resume", "checkpoint-2"), **save
    )
    resumed.fit()
    return {"steps": resumed.state.global_step}, full_weights(resumed)


def _export(strategy: Any, root: str, world: int) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    trainer = trainer_for(strategy, root, "export", world)
    trainer.fit()
    folder = os.path.join(root, "export", "final")
    trainer.save_model(folder)
    live = full_weights(trainer)
    plain = ContractNet()
    plain.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))  # loadable without kiln
    loaded = {k: v.float() for k, v in plain.state_dict().items()}
    return {"matches_live": all(torch.equal(loaded[k], live[k]) for k in live)}, loaded


def _auto_batch_size(strategy: Any, root: str, world: int) -> tuple[dict, dict]:
    trainer = trainer_for(strategy, root, "auto_batch_size", world, auto_find_batch_size=True)
    trainer.fit()
    return {"global_batch": trainer._train_batch_size * trainer.strategy.data_shards}, full_weights(trainer)


def _full_eval(strategy: Any, root: str, world: int) -> tuple[dict, dict]:
    trainer = trainer_for(strategy, root, "full_eval", world, bf16_full_eval=True)
    return {"eval_loss": trainer.evaluate()["eval_loss"]}, {}


RUNNERS: dict[str, Callable[[Any, str, int], tuple[dict, dict]]] = {
    "fit": _fit,
    "evaluate": _evaluate,
    "predict": _predict,
    "resume": _resume,
    "export": _export,
    "auto_batch_size": _auto_batch_size,
    "full_eval": _full_eval,
}


def run_all(strategy: Any, root: str, world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """{scenario: result or {"refused": message}}, and the tensors as `<scenario>/<name>`."""
    results: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name in SCENARIOS:
        try:
            result, named = RUNNERS[name](strategy, root, world)
        except Refused as err:
            results[name] = {"refused": str(err)}
            continue
        results[name] = result
        tensors.update({f"{name}/{k}": v for k, v in named.items()})
    return results, tensors
