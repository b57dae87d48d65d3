"""kiln's default collator turns `label` / `label_ids` into `labels` exactly as HF's default_data_collator
does: same keys, same values, same dtype (a Python-float label is float32, not default_collate's float64,
which would promote a float32 regression head's loss to float64)."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.data.collator import default_data_collator

hf_collator = pytest.importorskip("transformers.data.data_collator").default_data_collator

CASES = {
    "int label": [{"x": torch.ones(3) * i, "label": i} for i in range(4)],
    "float label": [{"x": torch.ones(3) * i, "label": i / 2} for i in range(4)],
    "label_ids": [{"x": torch.ones(3) * i, "label_ids": [i, i + 1]} for i in range(4)],
    "float label_ids": [{"x": torch.ones(3) * i, "label_ids": [i / 2, i + 1.5]} for i in range(4)],
    "0-d tensor label": [{"x": torch.ones(3) * i, "label": torch.tensor(i)} for i in range(4)],
    "0-d float64 tensor label": [
        {"x": torch.ones(3) * i, "label": torch.tensor(i / 3, dtype=torch.float64)} for i in range(4)
    ],
    "int label from 1": [{"x": torch.ones(3) * i, "label": i + 1} for i in range(4)],
    "label_ids from 2": [{"x": torch.ones(3) * i, "label_ids": [i + 2, 1]} for i in range(4)],
    "tensor label_ids": [{"x": torch.ones(3) * i, "label_ids": torch.tensor([i, 2])} for i in range(4)],
    "list input_ids": [{"input_ids": [1, 2, i], "label": i} for i in range(4)],
    "label alone": [{"label": i} for i in range(4)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_labels_as_hf_makes_them(name):
    features = CASES[name]
    ours, hf = default_data_collator([dict(f) for f in features]), hf_collator([dict(f) for f in features])
    assert sorted(ours) == sorted(hf) and "label" not in ours and "label_ids" not in ours
    for key in hf:
        assert ours[key].dtype == hf[key].dtype, key
        assert torch.equal(ours[key], hf[key]), key


def test_a_float_label_keeps_a_float32_regression_loss_in_float32():
    batch = default_data_collator([dict(f) for f in CASES["float label"]])
    loss = torch.nn.functional.mse_loss(torch.nn.Linear(3, 1)(batch["x"]).squeeze(-1), batch["labels"])
    assert loss.dtype == torch.float32  # float64 labels would promote the loss (and its backward) to float64
