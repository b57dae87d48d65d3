"""Dataset items of the wrong shape for a TrainingModule (strings, tuples, a missing key, dicts where
the step unpacks a tuple) fail with kiln's sentence about the data before the first step, not with a
KeyError/TypeError from inside the user's training_step (issue 34, item 11)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import Trainer, TrainingModule
from kiln.engine.data.checks import check_step_input
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data


class Pairs(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.lin(x).squeeze(-1), y)


class Optional_(TinyRegressor):
    def training_step(self, batch):
        extra = batch["w"].sum() if "w" in batch else 0.0
        return F.mse_loss(self(batch["x"]), batch["y"]) + extra


class Scaled(TinyRegressor):
    def training_step(self, batch):
        scales = {"a": 2.0}
        scale = scales["a"] if "a" in scales else 1.0  # a membership test on another name keeps the check on
        return F.mse_loss(self(batch["x"]), batch["y"]) * scale


def _pairs(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(8), torch.randn(())) for _ in range(n)]


@pytest.mark.parametrize(
    "module, data, sentence",
    [
        (
            TinyRegressor(),
            ["some text"] * 4,
            r"TinyRegressor.training_step reads batch\['x'\], but the dataset's items are "
            r"str, which batch into a list: return dicts such as \{'x': ...\}",
        ),
        (
            TinyRegressor(),
            _pairs(),
            r"reads batch\['x'\], but the dataset's items are tuple \(tensor\[8\], tensor\[\]\)",
        ),
        (
            TinyRegressor(),
            [{"x": torch.randn(8)}] * 4,
            r"reads batch\['y'\], which the batches lack: the dataset's items are "
            r"dict with keys \['x'\]; add 'y' to the items",
        ),
        (Scaled(), [{"x": torch.randn(8)}] * 4, r"Scaled.training_step reads batch\['y'\], which the batches lack"),
        (
            Pairs(),
            regression_data(4),
            r"Pairs.training_step unpacks the batch as a sequence, but the dataset's items are dict "
            r"with keys \['x', 'y'\], which batch into a dict",
        ),
        (
            Pairs(),
            [(torch.randn(8),)] * 4,
            r"unpacks the batch into 2 values, but the dataset's items are tuple \(tensor\[8\]\), "
            r"which batch into 1",
        ),
    ],
)
def test_wrong_shape_is_one_sentence(module: TrainingModule, data: list, sentence: str) -> None:
    with pytest.raises(KilnError, match=sentence):
        check_step_input(module, data, None)


@pytest.mark.parametrize(
    "module, data, collator",
    [
        (TinyRegressor(), regression_data(4), None),
        (Pairs(), _pairs(), None),
        (Optional_(), regression_data(4), None),  # `"w" in batch`: an optional key is not required
        (
            TinyRegressor(),
            [{"x": torch.randn(8)}] * 4,  # the collator adds the key the items lack
            lambda items: {"x": torch.stack([i["x"] for i in items]), "y": torch.zeros(len(items))},
        ),
        (nn.Linear(2, 2), ["text"] * 4, None),  # not a TrainingModule: check_first_item's business
    ],
)
def test_data_that_fits_passes(module: nn.Module, data: list, collator) -> None:
    check_step_input(module, data, collator)


def test_fit_refuses_before_the_first_step(tmp_path) -> None:
    model = TinyRegressor()
    before = flat_params(model).clone()
    trainer = Trainer(model, base_config(tmp_path, max_steps=2), train_dataset=[{"x": torch.randn(8)}] * 8)
    with pytest.raises(KilnError, match=r"reads batch\['y'\], which the batches lack"):
        trainer.fit()
    assert trainer.state.global_step == 0 and torch.equal(flat_params(model), before)
