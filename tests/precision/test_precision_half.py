"""True half precision (model cast to fp16/bf16) and `full_eval`."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from kiln.precision.amp import BF16MixedPrecision
from kiln.precision.base import cast_floating
from kiln.precision.fp32 import FP32Precision
from kiln.precision.half import BF16TruePrecision, FP16TruePrecision

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)
        self.register_buffer("class_ids", torch.arange(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(())  # created inside forward: takes the default dtype
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * scale


@pytest.mark.parametrize("cls, dtype", [(BF16TruePrecision, torch.bfloat16), (FP16TruePrecision, torch.float16)])
def test_convert_module_casts_floating_params_and_buffers_only(cls, dtype, make_config):
    model = cls(make_config()).convert_module(Net())
    assert all(p.dtype == dtype for p in model.parameters())
    assert model.norm.running_mean.dtype == dtype
    assert model.norm.num_batches_tracked.dtype == torch.long and model.class_ids.dtype == torch.long


def test_bf16_true_trains_on_cpu(make_config):
    plugin = BF16TruePrecision(make_config(name="bf16-true"))
    plugin.check_device(CPU)
    model = plugin.convert_module(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    losses = []
    for _ in range(15):
        xb, yb = plugin.convert_input((x, y))
        assert xb.dtype == torch.bfloat16 and yb.dtype == torch.long
        with plugin.forward_context():
            assert torch.get_default_dtype() == torch.bfloat16
            logits = model(xb)
            loss = nn.functional.cross_entropy(logits, yb)
        assert torch.get_default_dtype() == torch.float32
        assert logits.dtype == torch.bfloat16
        plugin.backward(loss)
        plugin.unscale_gradients(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert plugin.optimizer_step(opt) is True
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # optimizer states follow the parameters (documented): no fp32 master copy
    state = opt.state[model.fc1.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_forward_context_restores_the_default_dtype_on_error(make_config):
    plugin = BF16TruePrecision(make_config())
    with pytest.raises(RuntimeError, match="boom"), plugin.forward_context():
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32


def test_fp16_true_on_a_cpu_without_fp16_kernels_runs_with_a_warning(make_config, no_fp16_kernels):
    with pytest.warns(UserWarning, match="fp16 runs on this CPU, but slowly.*precision: bf16"):
        FP16TruePrecision(make_config()).check_device(CPU)


def test_fp16_true_is_accepted_where_the_cpu_has_fp16(make_config, fp16_cpu):
    FP16TruePrecision(make_config()).check_device(CPU)


def test_cast_floating_keeps_structure_and_non_float_tensors():
    Pair = namedtuple("Pair", "a b")
    batch = {
        "x": torch.ones(2),
        "ids": torch.ones(2, dtype=torch.long),
        "nested": [Pair(torch.ones(1), torch.tensor([True])), (torch.ones(1, dtype=torch.float64), "text")],
        "od": OrderedDict(v=torch.ones(1)),
    }
    out = cast_floating(batch, torch.bfloat16)
    assert out["x"].dtype == torch.bfloat16 and out["ids"].dtype == torch.long
    assert isinstance(out["nested"][0], Pair) and out["nested"][0].a.dtype == torch.bfloat16
    assert out["nested"][0].b.dtype == torch.bool
    assert out["nested"][1][0].dtype == torch.bfloat16 and out["nested"][1][1] == "text"
    assert isinstance(out["od"], OrderedDict) and out["od"]["v"].dtype == torch.bfloat16


def test_mixed_and_fp32_plugins_leave_the_batch_alone(make_config):
    x = torch.ones(2)
    assert BF16MixedPrecision(make_config()).convert_input(x) is x
    assert FP32Precision(make_config()).convert_input(x) is x


# -- full_eval (HF fp16_full_eval / bf16_full_eval) ------------------------------------------
@pytest.mark.parametrize("full_eval, dtype", [(None, None), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_eval_dtype_follows_full_eval(full_eval, dtype, make_config):
    for cls in (FP32Precision, BF16MixedPrecision, BF16TruePrecision):
        assert cls(make_config(full_eval=full_eval)).eval_dtype == dtype
    assert FP32Precision(None).eval_dtype is None


def test_full_eval_casts_model_and_inputs_for_evaluation(make_config):
    """What the evaluation code does outside training with `eval_dtype`."""
    plugin = FP32Precision(make_config(full_eval="bf16"))
    plugin.check_device(CPU)
    model = Net().eval()
    model.to(dtype=plugin.eval_dtype)
    out = model(cast_floating(torch.randn(4, 8), plugin.eval_dtype))
    assert out.dtype == torch.bfloat16


def test_fp16_full_eval_on_a_cpu_without_fp16_runs_with_a_warning(make_config, no_fp16_kernels):
    with pytest.warns(UserWarning, match="fp16 runs on this CPU, but slowly"):
        BF16MixedPrecision(make_config(full_eval="fp16")).check_device(CPU)


def test_fp16_true_warns_when_adam_epsilon_vanishes_in_fp16(make_config, caplog):
    """Adam's default eps 1e-8 is 0 in fp16; the warning names the value and the one to use."""
    model = Net().half()
    plugin = FP16TruePrecision(make_config())
    with caplog.at_level("WARNING", logger="kiln.precision.half"):
        plugin.connect(model, torch.optim.AdamW(model.parameters(), eps=1e-8))
    assert [r.getMessage() for r in caplog.records] == [
        "precision 'fp16-true': the optimizer's eps=1e-08 rounds to 0 in fp16; set adam_epsilon: 0.0001 (or use bf16-true)."
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kiln.precision.half"):
        plugin.connect(model, torch.optim.AdamW(model.parameters(), eps=1e-4))
        BF16TruePrecision(make_config()).connect(model, torch.optim.AdamW(model.parameters(), eps=1e-8))
    assert caplog.records == []
    assert float(torch.tensor(1e-4, dtype=torch.float16)) > 0
