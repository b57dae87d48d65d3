"""Resume restores Python's and numpy's random streams, not only torch's: a collator that draws from
`random` or `np.random` (random masking, noise, augmentation) gives a killed-and-resumed run the same
weights, bit for bit, as a run that never stopped. The model has no dropout, so torch's RNG plays no
part: only the stream under test can make the runs differ."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data._utils.collate import default_collate

from tests.checkpoint.checkpoint_helpers import Crash, numeric_history, regression_data, train, weights


def python_noise(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = default_collate(features)
    batch["y"] = batch["y"] + torch.tensor([random.gauss(0.0, 0.5) for _ in features])
    return batch


def numpy_noise(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = default_collate(features)
    batch["y"] = batch["y"] + torch.from_numpy(np.random.normal(0.0, 0.5, len(features)).astype("float32"))
    return batch


def numpy_legacy_mask(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Randomly zeroes input features, as masking collators do (np.random.rand, the global legacy stream)."""
    batch = default_collate(features)
    batch["x"] = batch["x"] * torch.from_numpy((np.random.rand(*batch["x"].shape) > 0.3).astype("float32"))
    return batch


COLLATORS = {"python": python_noise, "numpy": numpy_noise, "numpy-mask": numpy_legacy_mask}
CFG = {"max_steps": 12, "save_steps": 5, "logging_steps": 2}


def _straight_and_resumed(tmp_path, collator, **cfg: Any):
    cfg = {**CFG, **cfg}
    eval_data = (lambda: regression_data(8, seed=5)) if cfg.get("eval_strategy") else None
    kw = {"data_collator": collator, "model_kw": {"dropout": 0.0}}
    straight = train(str(tmp_path / "straight"), cfg, regression_data, eval_data, **kw)
    with pytest.raises(Crash):
        train(str(tmp_path / "crashed"), cfg, regression_data, eval_data, crash_at=5, **kw)
    resumed = train(str(tmp_path / "crashed"), cfg, regression_data, eval_data, model_seed=1234, resume=True, **kw)
    return straight, resumed


@pytest.mark.parametrize("name", list(COLLATORS))
@pytest.mark.parametrize("evaluate", [False, True], ids=["train-only", "with-eval"])
def test_collator_randomness_resumes_bitwise(tmp_path, name, evaluate):
    """With evaluation every 4 steps the eval batches also go through the collator and draw from the
    stream between checkpoints; the resumed run must still continue the stream exactly."""
    extra = {"eval_strategy": "steps", "eval_steps": 4} if evaluate else {}
    straight, resumed = _straight_and_resumed(tmp_path, COLLATORS[name], **extra)
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), f"{name}: weights differ after resume"
    assert numeric_history(resumed) == numeric_history(straight)


@pytest.mark.parametrize("name", list(COLLATORS))
def test_the_collator_randomness_changes_the_result(tmp_path, name):
    """Guard: the drawn numbers really reach the weights (else the test above proves nothing). A run
    whose stream starts elsewhere ends elsewhere."""
    cfg = {**CFG, "save_strategy": "no"}
    first = weights(
        train(str(tmp_path / "a"), cfg, regression_data, data_collator=COLLATORS[name], model_kw={"dropout": 0.0})
    )

    class Shifted:
        """Draws once from every stream before the first batch, then collates as the collator under test."""

        def __init__(self) -> None:
            self.shifted = False

        def __call__(self, features: list[Any]) -> Any:
            if not self.shifted:
                random.random(), np.random.rand()
                self.shifted = True
            return COLLATORS[name](features)

    second = weights(
        train(str(tmp_path / "b"), cfg, regression_data, data_collator=Shifted(), model_kw={"dropout": 0.0})
    )
    assert any(not torch.equal(first[k], second[k]) for k in first)
