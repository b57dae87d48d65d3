"""The window seam (`OwnsMicroBatchWindow`, kiln/strategies/interfaces.py): a strategy that runs the whole
accumulation window itself, as a pipeline schedule does, joins with one registry line and no engine edit.

`ToyPipeline` below is a 2-stage pipeline over 2 gloo processes: rank 0 holds the model's first stage
(embedding + mixing layer), rank 1 the second (the head, and the loss); activations go forward and their
gradients back with torch.distributed send/recv, and the window's micro-batches are scheduled GPipe-style
(every forward, then every backward). Both ranks read the same data (one data shard). Its per-step losses
and final weights equal `single`'s on the same model, data and accumulation; the window holds micro-batches
with different item counts and the epoch ends on a short window, so kiln's loss weights are exercised.

Run as a script under torchrun, this file is the worker (`python -m torch.distributed.run ... THIS OUT`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if __name__ == "__main__":  # the torchrun worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kiln.strategies import STRATEGIES  # noqa: E402
from kiln.strategies.base import Strategy  # noqa: E402
from kiln.strategies.capabilities import Capabilities  # noqa: E402
from kiln.strategies.collectives import ProcessGroupCollectives  # noqa: E402
from kiln.strategies.interfaces import LossWeights, OwnsMicroBatchWindow  # noqa: E402
from kiln.utils.errors import KilnError  # noqa: E402
from tests.helpers import padded_token_data  # noqa: E402
from tests.world import run_world


class Stem(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.emb(input_ids)))


class TwoStageLM(nn.Module):
    """An HF-contract token model in two stages: `stem` (rank 0 under the pipeline) and `head` (rank 1)."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.stem = Stem(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.loss(self.head(self.stem(input_ids)), labels)}


@STRATEGIES.register("toy_pipeline")
class ToyPipeline(ProcessGroupCollectives, Strategy, OwnsMicroBatchWindow):
    """Two stages over two processes, GPipe's schedule: all forwards of the window, then all backwards."""

    name = "toy_pipeline"
    capabilities = Capabilities(
        devices=frozenset({"cpu"}),
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        torch_compile=False,
    )

    data_shards = item_shards = grad_divisor = 1  # both stages read the same batches; no gradient is reduced
    data_shard_rank = 0
    schedule: list[str] = []  # what this rank did, in order (F<i> / B<i> per micro-batch), for the test

    def setup_module(self, module: nn.Module) -> nn.Module:
        self.full = module
        return (module.stem if self.global_rank == 0 else module.head).to(self.root_device)

    def run_window(self, model: nn.Module, window: list[Any], weights: LossWeights | None) -> list[torch.Tensor]:
        first = self.global_rank == 0
        kept = []  # stage 0: its outputs; stage 1: (its input, its weighted loss)
        for i, batch in enumerate(window):  # every forward
            ids = batch["input_ids"]
            with self.precision.forward_context():
                if first:
                    out = model(ids)
                    dist.send(out.detach(), dst=1)
                    kept.append(out)
                else:
                    hidden = torch.empty(*ids.shape, model.in_features)
                    dist.recv(hidden, src=0)
                    hidden.requires_grad_()
                    loss = self.full.loss(model(hidden), batch["labels"])
                    weight = weights.weight(i) if weights is not None else None
                    kept.append((hidden, loss * weight if weight is not None else loss))
            self.schedule.append(f"F{i}")
        for i in range(len(window)):  # every backward
            if first:
                grad = torch.empty_like(kept[i])
                dist.recv(grad, src=1)
                kept[i].backward(grad)
            else:
                hidden, loss = kept[i]
                self.precision.backward(loss)
                dist.send(hidden.grad, dst=0)
            self.schedule.append(f"B{i}")
        losses = torch.stack([loss.detach() for _, loss in kept]) if not first else torch.empty(len(window))
        dist.broadcast(losses, src=1)  # every rank logs the losses and guards against non-finite ones
        return list(losses.unbind())

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Global clipping: the norm over both stages' gradients."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = torch.stack([g.pow(2).sum() for g in grads]).sum()
        dist.all_reduce(squares)
        norm = squares.sqrt()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
        return norm


def config(out: str, strategy: str) -> dict[str, Any]:
    """7 micro-batches of 3 (the last of 2), 2 a window: three windows of two, then a short one of one."""
    return {
        "output_dir": out,
        "seed": 5,
        "learning_rate": 0.05,
        "num_train_epochs": 1,
        "per_device_train_batch_size": 3,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.5,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": {"name": strategy, "device": "cpu"},
    }


def train(out: str, strategy: str, trainer_class: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `TwoStageLM`; the per-step logged losses and the final weights. Each Trainer tears its process
    group down, so the job's next Trainer makes the default group again from the launcher's store (in a
    namespace of its own: the old group's gloo addresses are still there)."""
    from kiln import Trainer

    torch.manual_seed(0)
    model = TwoStageLM()
    trainer = (trainer_class or Trainer)(
        model, config(out, strategy), train_dataset=padded_token_data(20, length=6, seed=1)
    )
    trainer.fit()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.teardown()
    return losses, state


def worker(out: str) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in TwoStageLM().state_dict().items()}
    losses, state = train(os.path.join(out, "pp"), "toy_pipeline")
    own = "stem." if rank == 0 else "head."
    untouched = all(torch.equal(v, initial[k]) for k, v in state.items() if not k.startswith(own))

    class OwnLoss(__import__("kiln").Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    try:
        train(os.path.join(out, "refused"), "toy_pipeline", OwnLoss)
        refused = ""
    except KilnError as err:
        refused = str(err)
    torch.save(
        {
            "losses": losses,
            "state": {k: v for k, v in state.items() if k.startswith(own)},
            "others_untouched": untouched,
            "schedule": ToyPipeline.schedule,
            "refused": refused,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


@pytest.mark.distributed
def test_a_window_owning_two_stage_pipeline_equals_single(tmp_path):
    run_world(__file__, tmp_path, timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    want_losses, want_state = train(str(tmp_path / "single"), "single")
    assert len(want_losses) == 4  # three windows of two micro-batches, then one of one
    for rank in ranks:  # rank 0 holds no loss of its own: the last stage's were broadcast to it
        torch.testing.assert_close(rank["losses"], want_losses, rtol=1e-5, atol=1e-6)
    got_state = {**ranks[0]["state"], **ranks[1]["state"]}
    assert sorted(got_state) == sorted(want_state)
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} differs from single")
    assert all(rank["others_untouched"] for rank in ranks)  # each rank trained its own stage only
    gpipe = ["F0", "F1", "B0", "B1"] * 3 + ["F0", "B0"]  # every forward of a window before its backwards
    assert ranks[0]["schedule"] == ranks[1]["schedule"] == gpipe
    for rank in ranks:  # an override that acts per micro-batch would never be called under the schedule
        assert "OwnLoss.compute_loss" in rank["refused"] and "never be called" in rank["refused"]


def test_an_optimizer_that_steps_inside_backward_is_refused_under_a_window_owner():
    from types import SimpleNamespace

    from kiln.engine.loop.step_errors import refuse_per_micro_batch_overrides

    class Lomo:  # stands in for an optimizer that updates the weights inside backward
        pass

    run = SimpleNamespace(backward_owner=object(), optimizer=Lomo())
    with pytest.raises(KilnError, match="Lomo updates the weights inside backward, but strategy 'toy_pipeline'"):
        refuse_per_micro_batch_overrides(lambda *a: None, run, "toy_pipeline")
    refuse_per_micro_batch_overrides(lambda *a: None, SimpleNamespace(backward_owner=None), "toy_pipeline")


if __name__ == "__main__":
    worker(sys.argv[1])
