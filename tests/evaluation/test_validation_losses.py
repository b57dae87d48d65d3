"""What `eval_loss` is for a TrainingModule whose validation_step returns a batch-mean loss or one loss
per sample: both are averaged over samples, a short last batch counting for its own samples only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln import Trainer, TrainingModule


class PerSample(TrainingModule):
    def __init__(self, reduce: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.reduce = reduce

    def training_step(self, batch: Any) -> torch.Tensor:
        return (self.w * batch["x"]).mean()

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        losses = self.w * batch["x"]
        return {"loss": losses.mean() if self.reduce else losses}


@pytest.mark.parametrize("reduce", [True, False], ids=["batch-mean", "per-sample"])
def test_eval_loss_is_the_mean_over_samples(reduce: bool, tmp_path: Any) -> None:
    rows = [{"x": torch.tensor(float(i * i))} for i in range(10)]  # batches of 4, 4 and 2
    trainer = Trainer(
        PerSample(reduce), {"output_dir": str(tmp_path), "per_device_eval_batch_size": 4, "report_to": "none"}
    )
    assert trainer.evaluate(rows)["eval_loss"] == pytest.approx(sum(i * i for i in range(10)) / 10)
