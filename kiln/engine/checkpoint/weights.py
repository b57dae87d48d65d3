"""Which trained weights `kiln evaluate` / `kiln predict` score, and loading them without optimizer
state. A run's weights are, in order of preference: the best checkpoint its trainer state records,
the model `kiln fit` exported into output_dir at the end, the newest complete checkpoint."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.engine.checkpoint.files import MARKER, is_complete, list_checkpoints, why_damaged, why_incomplete
from kiln.engine.checkpoint.signing import SigningKey
from kiln.engine.model.peft import ADAPTER_BIN, ADAPTER_SAFE, checkpoint_io_for
from kiln.strategies.model_weights import WEIGHTS_BIN, WEIGHTS_SAFE
from kiln.utils.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

    from kiln.strategies.base import Strategy

STATE = "trainer_state.json"


@dataclass(frozen=True)
class EvalWeights:
    """A folder holding model weights, the optimizer step they were saved at (None: unknown) and
    why it was chosen ('given', 'best checkpoint', 'exported model', 'last checkpoint')."""

    path: str
    step: int | None
    origin: str
    epoch: float | None = None

    def describe(self) -> str:
        step = f"step {self.step}" if self.step is not None else "step unknown"
        return f"{self.origin} {self.path} ({step})"


def load_weights_for_eval(strategy: Strategy, wrapped: nn.Module, module: nn.Module, path: str) -> None:
    """Load the model weights in `path` (a checkpoint or a save_model folder) into `module` (the
    user's model) as the strategy placed it (`wrapped`, its set-up module), through the strategy's
    CheckpointIO (`load_weights_only`; a PeftModel's adapter, as HF's `load_adapter`), leaving optimizer
    and scheduler alone. The one place evaluation-time weight loading happens (`Trainer._load_from_checkpoint`)."""
    checkpoint_io_for(strategy, module).load_weights_only(path, model=wrapped, module=module)


def _state(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, STATE), encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _holds_weights(path: str) -> bool:
    names = (
        WEIGHTS_SAFE,
        WEIGHTS_BIN,
        f"{WEIGHTS_SAFE}.index.json",
        ADAPTER_SAFE,
        ADAPTER_BIN,
    )  # save_model of a PeftModel
    return any(os.path.exists(os.path.join(path, name)) for name in names)


def weights_step(path: str) -> int | None:
    """The global step of the weights in `path`: its trainer_state.json, else its checkpoint-<N> name."""
    step = _state(path).get("global_step")
    if isinstance(step, int):
        return step
    name = os.path.basename(os.path.normpath(path))
    return int(name.rsplit("-", 1)[1]) if name.startswith("checkpoint-") and name.rsplit("-", 1)[1].isdigit() else None


def _weights(path: str, origin: str) -> EvalWeights:
    epoch = _state(path).get("epoch")
    return EvalWeights(path, weights_step(path), origin, float(epoch) if isinstance(epoch, (int, float)) else None)


def given_weights(path: str, key: SigningKey | None = None) -> EvalWeights:
    """`--weights PATH`: a complete checkpoint or a folder written by save_model (with a signing `key`,
    only a checkpoint whose signature verifies: kiln.engine.checkpoint.signing)."""
    if not os.path.isdir(path):
        raise CheckpointError(
            f"--weights {path!r} is not a folder; pass a checkpoint-<step> folder or one written by "
            "trainer.save_model() / kiln fit."
        )
    marked = os.path.exists(os.path.join(path, MARKER))
    if marked and (incomplete := why_incomplete(path)) is not None:
        raise CheckpointError(
            f"--weights {path!r} is an incomplete or damaged checkpoint ({incomplete}); pass another checkpoint."
        )
    if not marked and key is not None:
        raise CheckpointError(
            f"--weights {path!r} has no {MARKER} marker, so it carries no signature, and save.signing_key_env "
            f"({key.env}) asks for signed checkpoints only; pass a signed checkpoint-<step> folder."
        )
    _refuse_damaged(path, "--weights", key)
    return _weights(path, "given weights")


def _refuse_damaged(path: str, what: str, key: SigningKey | None) -> None:
    """Weights whose bytes changed since the checkpoint was written (or whose signature does not
    verify) would score silently wrong."""
    reason = why_damaged(path, key) if os.path.exists(os.path.join(path, MARKER)) else None
    if reason is not None:
        raise CheckpointError(f"{what} {path!r} is damaged: {reason}; pass another checkpoint with --weights.")


def find_run_weights(output_dir: str, key: SigningKey | None = None) -> EvalWeights | None:
    """The run's best checkpoint, else its exported model, else its newest complete checkpoint. With a
    signing `key` the exported model (unsigned: only checkpoints are signed) is passed over."""
    complete = [path for _, path in list_checkpoints(output_dir) if is_complete(path)]
    states = [_state(output_dir)] + [_state(path) for path in reversed(complete)]
    for state in states:
        best = state.get("best_model_checkpoint")
        if isinstance(best, str):
            for path in complete:  # recorded absolute or relative; the run folder may have moved
                if os.path.basename(path) == os.path.basename(os.path.normpath(best)):
                    _refuse_damaged(path, "the best checkpoint", key)
                    return _weights(path, "best checkpoint")
    if key is None and _holds_weights(output_dir):
        return _weights(output_dir, "exported model")
    if complete:
        _refuse_damaged(complete[-1], "the last checkpoint", key)
        return _weights(complete[-1], "last checkpoint")
    return None
