"""fp16 on a CPU without native fp16 kernels (issue 30 item 3): HF's Trainer accepts `fp16` and
`fp16_full_eval` there, so kiln trains and evaluates in fp16 too (torch's CPU autocast and
GradScaler('cpu'), through slower kernels), with one warning that it is slow."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, regression_data


@pytest.mark.parametrize(
    "settings", [{"fp16": True, "fp16_full_eval": True}, {"precision": "16-mixed"}], ids=["hf-names", "16-mixed"]
)
def test_trains_and_evaluates_with_one_warning(tmp_path, no_fp16_kernels, settings):
    seen = []

    class Probe(TinyRegressor):
        def forward(self, x):
            out = super().forward(x)
            seen.append((self.training, out.dtype))
            return out

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            Probe(),
            base_config(tmp_path, max_steps=4, **settings),
            train_dataset=regression_data(32),
            eval_dataset=regression_data(16),
        )
        trainer.fit()
        metrics = trainer.evaluate()
    slow = [str(w.message) for w in caught if "fp16 runs on this CPU, but slowly" in str(w.message)]
    assert len(slow) == 1
    assert trainer.precision.name == "fp16" and trainer.state.global_step == 4
    assert {dtype for training, dtype in seen if training} == {torch.float16}  # autocast
    assert math.isfinite(metrics["eval_loss"])
    if "fp16_full_eval" in settings:
        assert {dtype for training, dtype in seen if not training} == {torch.float16}  # the model cast to fp16


def test_hf_trainer_accepts_fp16_on_this_cpu(tmp_path):
    """The reference: HF's Trainer builds and trains with fp16 on the CPU rather than refusing."""
    transformers = pytest.importorskip("transformers")

    class Model(TinyRegressor):
        def forward(self, x, labels=None):
            out = super().forward(x)
            return {"loss": ((out.float() - labels) ** 2).mean()}

    data = [{"x": item["x"], "labels": item["y"]} for item in regression_data(16)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        fp16=True,
        max_steps=2,
        per_device_train_batch_size=4,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=Model(), args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 2
