"""fp16 with gradient clipping through the Trainer (the strategy's clip, not a hand-driven plugin):
gradients must be unscaled before their norm is taken and clipped. Checked against a hand-written
`torch.amp.GradScaler` loop: same weights, and the logged grad_norm is the true (unscaled) norm.
Clipped before unscaling, grad_norm would be ~2**16 times too large and the update ~2**16 too small."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data._utils.collate import default_collate

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data

LR, CLIP, SEED, STEPS = 0.05, 1.0, 3, 10


def hand_fp16_loop(model, data, batch: int, accum: int) -> tuple[torch.nn.Module, list[float]]:
    """The reference: SGD, constant lr, autocast fp16, GradScaler('cpu'), unscale -> clip -> step.
    Returns the model and the gradient norm of every step (before clipping; inf/nan when skipped)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    norms, step, epoch = [], 0, 0
    while step < STEPS:
        # kiln's documented sample order: randperm seeded with seed + epoch
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        batches = [default_collate([data[i] for i in order[j : j + batch]]) for j in range(0, len(order), batch)]
        for w in range(0, len(batches), accum):
            window = batches[w : w + accum]
            for b in window:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model.training_step(b)
                scaler.scale(loss * (len(b["y"]) / sum(len(x["y"]) for x in window))).backward()
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == STEPS:
                break
        epoch += 1
    return model, norms


@pytest.mark.parametrize("accum", [1, 2])
def test_fp16_trainer_clips_unscaled_gradients_like_a_grad_scaler_loop(tmp_path, fp16_cpu, accum):
    data = regression_data(n=24)
    batch = 8 // accum
    torch.manual_seed(0)
    ref, norms = hand_fp16_loop(TinyRegressor(), data, batch, accum)
    torch.manual_seed(0)
    model = TinyRegressor()
    cfg = base_config(
        tmp_path,
        precision="fp16",
        optim="sgd",
        lr_scheduler_type="constant",
        learning_rate=LR,
        max_grad_norm=CLIP,
        max_steps=STEPS,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        seed=SEED,
        logging_steps=1,
    )
    trainer = Trainer(model, cfg, train_dataset=data)
    trainer.fit()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    # the default initial scale (2**16) overflows on some steps: both loops skip the same ones
    skipped = [i for i, n in enumerate(norms) if not math.isfinite(n)]
    assert [i for i, n in enumerate(logged) if not math.isfinite(n)] == skipped
    assert trainer.precision.skipped_steps == len(skipped) and STEPS - len(skipped) >= 6
    finite = [n for n in norms if math.isfinite(n)]
    assert min(finite) > 2 * CLIP  # clipping acts on every stepped step, so clipping wrongly would show
    assert [n for n in logged if math.isfinite(n)] == pytest.approx(finite, rel=1e-6)
    # not bitwise: kiln sums the norm over its optimizer groups (decay / no decay), in another order
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-6, atol=1e-7)
