"""Models, data and scenarios shared by the 2-process workers and the 1-process references in the
parent test process. Imported as `toy` by worker scripts (their folder is on sys.path) and as
`tests.distributed.toy` by the tests and by the CLI (`task.model: tests.distributed.toy:...`)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln import Callback, TrainingModule

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:  # worker scripts run with only their own folder on sys.path
    sys.path.insert(0, REPO)
from tests import helpers  # noqa: E402
from tests.helpers import flat_params  # noqa: E402,F401  (re-exported for the workers)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


class Regressor(TrainingModule):
    def __init__(self, d_in: int = 6, hidden: int = 12, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: dict) -> torch.Tensor:
        return F.mse_loss(self(batch["x"]), batch["y"])

    def validation_step(self, batch: dict) -> dict:
        pred = self(batch["x"])
        return {"loss": F.mse_loss(pred, batch["y"]), "predictions": pred, "labels": batch["y"]}


class WithUnused(Regressor):
    """A layer that forward never calls: no gradient on any rank (DDP's find_unused_parameters case)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(3, 3)


class TokenLM(TrainingModule):
    """Token-level loss over padded sequences: its items are the labels that are not -100."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def training_step(self, batch: dict) -> torch.Tensor:
        logits = self.head(self.emb(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


class HFTokenLM(nn.Module):
    """The Hugging Face contract, dividing by `num_items_in_batch` itself (as Transformers models do)."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, num_items_in_batch: Any = None
    ) -> dict:
        logits = self.head(self.emb(input_ids))
        out = {"logits": logits}
        if labels is not None:
            flat = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            out["loss"] = flat / (num_items_in_batch if num_items_in_batch is not None else labels.ne(-100).sum())
        return out


def regression_data(n: int = 32, d_in: int = 6, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return helpers.regression_data(n, d_in, seed)


def token_data(n: int = 32, length: int = 10, vocab: int = 11, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences with 1..length real tokens, so item counts differ between micro-batches and ranks."""
    return helpers.padded_token_data(n, length, vocab, seed)


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset (no length): kiln shards it per rank, every `world`-th item."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.items)


# name -> (model factory, data, config); `per_device` is the batch of ONE of two DDP ranks
SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {
        "model": Regressor,
        "data": lambda: regression_data(32),
        "per_device": 4,
        "accum": 1,
        "max_steps": 6,
        "extra": {},
    },
    "accum": {
        "model": Regressor,
        "data": lambda: regression_data(32),
        "per_device": 2,
        "accum": 2,
        "max_steps": 6,
        "extra": {},
    },
    "tokens": {
        "model": TokenLM,
        "data": lambda: token_data(32),
        "per_device": 2,
        "accum": 2,
        "max_steps": 6,
        "extra": {},
    },
    "iterable": {
        "model": Regressor,
        "data": lambda: Stream(regression_data(32)),
        "per_device": 4,
        "accum": 1,
        "max_steps": 6,
        "extra": {},
    },
    # 20 samples / (2 ranks x batch 2) = 5 micro-batches per rank: windows of 2, 2 and a short 1 each
    # epoch. The short window must synchronise gradients too (not run entirely under no_sync).
    "short_window": {
        "model": Regressor,
        "data": lambda: regression_data(20),
        "per_device": 2,
        "accum": 2,
        "max_steps": 6,
        "extra": {},
    },
    "tokens_short_window": {
        "model": TokenLM,
        "data": lambda: token_data(20),
        "per_device": 2,
        "accum": 2,
        "max_steps": 6,
        "extra": {},
    },
    # SGD without clipping: any wrong scale of the loss shows directly in the weights
    "hf_num_items": {
        "model": HFTokenLM,
        "data": lambda: token_data(32),
        "per_device": 2,
        "accum": 2,
        "max_steps": 6,
        "extra": {"optim": {"name": "sgd"}, "max_grad_norm": 0.0, "learning_rate": 0.5},
    },
    # each rank's own mean, averaged over ranks (no item-count all-reduce): checked against a hand-computed
    # mean of rank means, not against one process
    "tokens_rank_means": {
        "model": TokenLM,
        "data": lambda: token_data(32),
        "per_device": 2,
        "accum": 1,
        "max_steps": 1,
        "extra": {
            "optim": {"name": "sgd"},
            "max_grad_norm": 0.0,
            "learning_rate": 0.5,
            "average_tokens_across_devices": False,
        },
        "reference": "rank_means",
    },
}

if importlib.util.find_spec("torchao") is not None:
    from tests.precision.float8_models import Float8Regressor  # noqa: E402

    # precision fp8 (emulated): each rank's float8 scales come from its own shard, so the run is checked
    # against DDP's arithmetic done by hand (tests.precision.float8_models.hand_float8_sgd), not one process
    SCENARIOS["fp8_shards"] = {
        "model": Float8Regressor,
        "data": lambda: helpers.regression_data(32, d_in=16),
        "per_device": 4,
        "accum": 1,
        "max_steps": 4,
        "extra": {
            "precision": {"name": "fp8", "fp8": {"emulate": True}},
            "optim": {"name": "sgd"},
            "max_grad_norm": 0.0,
            "learning_rate": 0.05,
            "lr_scheduler_type": "constant",
        },
        "reference": "float8_shards",
    }


def scenario_config(name: str, output_dir: str, world: int, **extra: Any) -> dict[str, Any]:
    """The same global batch for `world` processes: per-device batch scales as 2 / world."""
    sc = SCENARIOS[name]
    cfg: dict[str, Any] = {
        "output_dir": output_dir,
        "seed": 3,
        "learning_rate": 1e-2,
        "max_steps": sc["max_steps"],
        "per_device_train_batch_size": sc["per_device"] * 2 // world,
        "gradient_accumulation_steps": sc["accum"],
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": {"name": "ddp" if world > 1 else "single", "device": "cpu"},
    }
    cfg.update(sc["extra"])
    cfg.update(extra)
    return cfg


def train_scenario(name: str, output_dir: str, world: int) -> tuple[Any, nn.Module]:
    from kiln import Trainer

    torch.manual_seed(0)
    model = SCENARIOS[name]["model"]()
    trainer = Trainer(model, scenario_config(name, output_dir, world), train_dataset=SCENARIOS[name]["data"]())
    trainer.fit()
    return trainer, model


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# -- for the CLI runs (`kiln fit --nproc 2`) ------------------------------------------------------
class KillAt(Callback):
    """Ends the process abruptly (no teardown, no final save) right after checkpoint `step` is written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            sys.stdout.flush()
            os._exit(0)


class FailAt(Callback):
    """Raises on one rank at one step: the other rank is then inside the next gradient all-reduce."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        import torch.distributed as dist

        if state.global_step == self.step and dist.is_initialized() and dist.get_rank() == self.rank:
            raise ValueError(f"injected failure on rank {self.rank} at step {self.step}")


class Audit(Callback):
    """Records what this rank writes below `root` (files opened for writing, folders made, renames,
    safetensors files) and dumps it to `audit/rank<r>.json` at the end of training."""

    def __init__(self, root: str, audit_dir: str) -> None:
        self.root, self.audit_dir = os.path.abspath(root), audit_dir
        self.events: list[list[str]] = []
        self.rank = int(os.environ.get("RANK", "0"))
        self.flags: dict[str, bool] = {}
        sys.addaudithook(self._hook)
        import atexit

        atexit.register(self._dump)  # after the CLI's save_model / save_state / save_metrics
        # safetensors and torch.save write from C++, which the audit hook does not see
        import safetensors.torch as st

        save_file, save = st.save_file, torch.save

        def audited_save_file(tensors: Any, filename: str, metadata: Any = None) -> None:
            self._note("safetensors", filename)
            save_file(tensors, filename, metadata=metadata)

        def audited_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            self._note("torch.save", f)
            save(obj, f, *args, **kwargs)

        st.save_file, torch.save = audited_save_file, audited_save

    def _note(self, kind: str, path: Any) -> None:
        path = os.path.abspath(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else None
        if path and path.startswith(self.root):
            self.events.append([kind, os.path.relpath(path, self.root)])

    def _hook(self, event: str, args: tuple) -> None:
        if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
            self._note("open", args[0])
        elif event in ("os.mkdir", "os.rename"):
            self._note(event, args[0])

    def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        self.flags = {
            "is_world_process_zero": state.is_world_process_zero,
            "is_local_process_zero": state.is_local_process_zero,
        }

    def _dump(self) -> None:
        os.makedirs(self.audit_dir, exist_ok=True)
        with open(os.path.join(self.audit_dir, f"rank{self.rank}.json"), "w") as fh:
            json.dump({"rank": self.rank, "events": self.events, **self.flags}, fh)


def cli_data(
    n: int = 48, kill_at: int = 0, fail_rank: int = -1, fail_step: int = 0, audit: str = "", root: str = ""
) -> dict[str, Any]:
    """`task.data` for the CLI runs: the data plus the callbacks a test asks for."""
    callbacks: list[Callback] = []
    if audit:
        callbacks.append(Audit(root, audit))
    if kill_at:
        callbacks.append(KillAt(kill_at))
    if fail_rank >= 0:
        callbacks.append(FailAt(fail_rank, fail_step))
    return {"train_dataset": regression_data(n), "callbacks": callbacks}


def cli_model(dropout: float = 0.1) -> Regressor:
    return Regressor(dropout=dropout)


def write_cli_config(path: str, output_dir: str, **data_args: Any) -> str:
    """A YAML config for `kiln fit` over `cli_model` / `cli_data` (dropout on: resume must restore RNG)."""
    from omegaconf import OmegaConf

    cfg = {
        "output_dir": output_dir,
        "seed": 5,
        "learning_rate": 1e-2,
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "save_steps": 3,
        "logging_steps": 1,
        "disable_tqdm": True,
        "strategy": {"name": "auto", "device": "cpu", "timeout": 60},
        "task": {
            "model": "tests.distributed.toy:cli_model",
            "data": "tests.distributed.toy:cli_data",
            "data_args": data_args,
        },
    }
    OmegaConf.save(OmegaConf.create(cfg), path)
    return path
