"""kiln vs a hand-written PyTorch loop: same model, data order and seed -> same weights."""

from __future__ import annotations

import torch
from torch.utils.data._utils.collate import default_collate

from kiln import Trainer
from tests.helpers import TinyRegressor, TokenModel, base_config, flat_params, padded_token_data, regression_data


def hand_loop(model, data, *, lr, wd, warmup, total_steps, batch, accum, clip, seed, epochs):
    """The reference: AdamW (no decay on biases / norm weights), HF's linear warmup schedule,
    clipping, gradient accumulation with loss / k, kiln's documented sample order."""
    no_decay = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    no_decay |= {id(p) for n, p in model.named_parameters() if n.endswith("bias")}
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if id(p) not in no_decay], "weight_decay": wd},
            {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.999),
        eps=1e-8,
    )

    def lam(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        batches = [default_collate([data[i] for i in order[j : j + batch]]) for j in range(0, len(order), batch)]
        for w in range(0, len(batches), accum):
            window = batches[w : w + accum]
            for b in window:
                (model.training_step(b) / len(window)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step == total_steps:
                return model
    return model


def test_weights_match_hand_written_loop(tmp_path):
    data = regression_data(n=48)
    torch.manual_seed(0)
    ref = hand_loop(
        TinyRegressor(), data, lr=1e-2, wd=0.01, warmup=3, total_steps=12, batch=4, accum=2, clip=0.5, seed=7, epochs=2
    )
    torch.manual_seed(0)
    model = TinyRegressor()
    cfg = base_config(
        tmp_path,
        learning_rate=1e-2,
        weight_decay=0.01,
        warmup_steps=3,
        max_steps=12,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        seed=7,
    )
    out = Trainer(model, cfg, train_dataset=data).fit()
    assert out.global_step == 12
    # 48 samples / 4 = 12 micro-batches = 6 steps per epoch, so 12 steps cross an epoch boundary
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-6, atol=1e-7)


def test_two_runs_same_config_are_identical(tmp_path):
    data = regression_data()
    results = []
    for i in range(2):
        cfg = base_config(tmp_path / str(i), learning_rate=1e-2, max_steps=10, per_device_train_batch_size=8)
        trainer = Trainer(model_init=lambda: TinyRegressor(dropout=0.2), config=cfg, train_dataset=data)
        trainer.fit()
        results.append(flat_params(trainer.model))
    assert torch.equal(results[0], results[1])


def _first_step_grads(tmp_path, data, batch, accum):
    grads = {}

    from kiln import Callback

    class Grab(Callback):
        def on_pre_optimizer_step(self, config, state, control, model=None, **kw):
            if state.global_step == 0:
                grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})

    torch.manual_seed(0)
    cfg = base_config(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        max_grad_norm=0.0,
        learning_rate=1e-3,
    )
    trainer = Trainer(TokenModel(), cfg, train_dataset=data, callbacks=[Grab()])
    trainer.fit()
    return grads


def test_accumulation_equals_big_batch_with_uneven_token_counts(tmp_path):
    """4 x 8 accumulated == one batch of 32, even though micro-batches hold very different numbers
    of real tokens: the window is normalised by its total token count (HF's num_items_in_batch)."""
    data = padded_token_data(n=64)
    big = _first_step_grads(tmp_path / "a", data, batch=32, accum=1)
    small = _first_step_grads(tmp_path / "b", data, batch=8, accum=4)
    assert big.keys() == small.keys()
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-5, atol=1e-7)


def test_naive_loss_over_k_would_differ(tmp_path):
    """Guard that the data really has uneven token counts (otherwise the test above proves nothing)."""
    data = padded_token_data(n=64)
    counts = [int((torch.stack([d["labels"] for d in data[i : i + 8]]) != -100).sum()) for i in range(0, 32, 8)]
    assert max(counts) - min(counts) >= 5


def test_last_short_window_is_normalised_by_its_own_count(tmp_path):
    """10 micro-batches with accumulation 4: the third step has 2 micro-batches and must equal one
    batch made of those two (not half of it, as loss / 4 would give)."""
    data = regression_data(n=20)
    grads = []

    from kiln import Callback

    class Grab(Callback):
        def on_pre_optimizer_step(self, config, state, control, **kw):
            if state.global_step == 2:
                grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))

    torch.manual_seed(0)
    model = TinyRegressor()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = base_config(
        tmp_path,
        num_train_epochs=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=0.0,
        max_grad_norm=0.0,
    )
    trainer = Trainer(model, cfg, train_dataset=data, callbacks=[Grab()])
    out = trainer.fit()
    assert out.global_step == 3  # ceil(10 / 4)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(42)).tolist()
    ref = TinyRegressor()
    ref.load_state_dict(init)
    batch = default_collate([data[i] for i in order[16:20]])
    ref.training_step(batch).backward()
    torch.testing.assert_close(grads[0], torch.cat([p.grad.flatten() for p in ref.parameters()]), rtol=1e-5, atol=1e-7)
