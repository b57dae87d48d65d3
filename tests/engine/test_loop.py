"""Step counting, logging cadence, callbacks and the model contracts the loop accepts."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from kiln import Callback, Trainer
from tests.helpers import TinyRegressor, TokenModel, base_config, padded_token_data, regression_data


@pytest.mark.parametrize(
    "n, batch, accum, epochs, max_steps, expected",
    [
        (40, 4, 1, 3, -1, 30),  # 10 batches/epoch
        (40, 4, 3, 1, -1, 4),  # ceil(10 / 3): the short last window is a step
        (40, 4, 3, 2, -1, 8),
        (40, 4, 1, 0.5, -1, 5),  # fractional epochs
        (40, 4, 1, 2.25, -1, 23),  # ceil(2.25 * 10)
        (40, 4, 1, 3, 7, 7),  # max_steps overrides epochs
        (40, 4, 1, 1, 25, 25),  # max_steps beyond one epoch re-iterates the data
    ],
)
def test_step_counting(tmp_path, n, batch, accum, epochs, max_steps, expected):
    cfg = base_config(
        tmp_path,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        num_train_epochs=epochs,
        max_steps=max_steps,
        learning_rate=1e-3,
    )
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(n))
    out = trainer.fit()
    assert out.global_step == expected == trainer.state.global_step
    if max_steps < 0:
        assert trainer.state.epoch == pytest.approx(
            min(epochs, math.ceil(epochs * math.ceil(n / batch / accum)) / math.ceil(n / batch / accum)), abs=0.11
        )


def test_logging_steps_first_step_and_history(tmp_path):
    cfg = base_config(tmp_path, max_steps=10, logging_steps=4, logging_first_step=True, learning_rate=1e-3)
    cfg["log"]["steps"] = 4
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(64))
    trainer.fit()
    steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert steps == [1, 4, 8]
    first = trainer.state.log_history[0]
    assert set(first) == {
        "loss",
        "grad_norm",
        "learning_rate",
        "epoch",
        "step",
    }  # HF's keys; throughput goes to loggers
    assert "train_runtime" in trainer.state.log_history[-1] and "train_loss" in trainer.state.log_history[-1]


def test_logged_loss_is_mean_of_step_losses(tmp_path):
    losses = []

    class Record(Callback):
        def on_step_end(self, config, state, control, **kw):
            pass

    class M(TinyRegressor):
        def training_step(self, batch):
            loss = super().training_step(batch)
            losses.append(loss.item())
            return loss

    cfg = base_config(tmp_path, max_steps=6, learning_rate=1e-3)
    cfg["log"]["steps"] = 3
    trainer = Trainer(M(), cfg, train_dataset=regression_data(64), callbacks=[Record])
    trainer.fit()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx([sum(losses[:3]) / 3, sum(losses[3:6]) / 3], rel=1e-6)


def test_a_loss_of_shape_one_is_logged_like_a_scalar(tmp_path):
    """The queued losses are read in one stacked transfer; a step returning shape (1,) still logs its mean."""
    losses = []

    class M(TinyRegressor):
        def training_step(self, batch):
            loss = super().training_step(batch).reshape(1)
            losses.append(loss.item())
            return loss

    cfg = base_config(tmp_path, max_steps=4, learning_rate=1e-3)
    cfg["log"]["steps"] = 2
    trainer = Trainer(M(), cfg, train_dataset=regression_data(64))
    out = trainer.fit()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx([sum(losses[:2]) / 2, sum(losses[2:4]) / 2], rel=1e-6)
    assert out.training_loss == pytest.approx(sum(losses) / 4, rel=1e-6)


def test_nan_loss_is_filtered_in_logs_only(tmp_path):
    calls = {"n": 0}

    class Nan(TinyRegressor):
        def training_step(self, batch):
            calls["n"] += 1
            loss = super().training_step(batch)
            return loss * float("nan") if calls["n"] == 2 else loss

    cfg = base_config(tmp_path, max_steps=4, learning_rate=0.0, max_grad_norm=0.0)
    cfg["log"]["steps"] = 4
    trainer = Trainer(Nan(), cfg, train_dataset=regression_data(64))
    out = trainer.fit()
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    # one window of every step: train_loss is the same filtered mean, not nan (only an all-nan run's is)
    assert out.training_loss == pytest.approx(trainer.state.log_history[0]["loss"], rel=1e-12)


def test_callback_can_stop_training_and_force_a_log(tmp_path):
    class StopAt3(Callback):
        def on_step_end(self, config, state, control, **kw):
            if state.global_step == 3:
                control.should_log = True
                control.should_training_stop = True

    cfg = base_config(tmp_path, max_steps=50, learning_rate=1e-3)
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(64), callbacks=[StopAt3()])
    out = trainer.fit()
    assert out.global_step == 3
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [3]


def test_event_order(tmp_path):
    events = []

    class Spy(Callback):
        pass

    for name in (
        "on_train_begin",
        "on_epoch_begin",
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
        "on_epoch_end",
        "on_train_end",
        "on_log",
    ):
        setattr(Spy, name, lambda self, c, s, ctl, _n=name, **kw: events.append(_n))
    cfg = base_config(tmp_path, max_steps=1, gradient_accumulation_steps=2, learning_rate=1e-3)
    Trainer(TinyRegressor(), cfg, train_dataset=regression_data(16), callbacks=[Spy()]).fit()
    assert events == [
        "on_train_begin",
        "on_epoch_begin",
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
        "on_epoch_end",
        "on_log",
        "on_train_end",
    ]


def test_hf_contract_model_plain_module(tmp_path):
    class HFStyle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            pred = self.lin(x).squeeze(-1)
            return {"loss": F.mse_loss(pred, labels), "logits": pred}

    data = [{"x": d["x"], "labels": d["y"], "extra": 1} for d in regression_data(32)]  # `extra` is dropped
    out = Trainer(HFStyle(), base_config(tmp_path, max_steps=5, learning_rate=1e-2), train_dataset=data).fit()
    assert out.global_step == 5 and math.isfinite(out.training_loss)


def test_transformers_model_from_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 50, (16,), generator=g)), "labels": ids} for _ in range(32)]
    trainer = Trainer(model, base_config(tmp_path, max_steps=8, learning_rate=5e-3), train_dataset=data)
    out = trainer.fit()
    assert out.global_step == 8 and math.isfinite(out.training_loss)
    assert "train_tokens_per_second" in out.metrics
    # HF's own count (Trainer.floating_point_ops reads only `self.model`), per micro-batch of 8 x 16 tokens
    hf = transformers.Trainer.floating_point_ops(types.SimpleNamespace(model=model), {"input_ids": torch.zeros(8, 16)})
    assert hf == 6 * 8 * 16 * model.num_parameters(exclude_embeddings=True)  # the embedding tables are not counted
    assert out.metrics["total_flos"] == 8 * hf


def test_dataloader_is_used_as_given(tmp_path):
    loader = torch.utils.data.DataLoader(regression_data(20), batch_size=5, shuffle=False)
    trainer = Trainer(
        TinyRegressor(), base_config(tmp_path, num_train_epochs=2, learning_rate=1e-3), train_dataset=loader
    )
    assert trainer.fit().global_step == 8


def test_iterable_dataset_with_max_steps(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(regression_data(12))

    out = Trainer(
        TinyRegressor(),
        base_config(tmp_path, max_steps=7, per_device_train_batch_size=4, learning_rate=1e-3),
        train_dataset=Stream(),
    ).fit()
    assert out.global_step == 7  # 3 batches per pass, re-iterated until max_steps


def test_user_optimizer_and_configure_optimizers(tmp_path):
    model = TinyRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = [p.clone() for p in model.parameters()]
    Trainer(model, base_config(tmp_path, max_steps=3), train_dataset=regression_data(16), optimizers=(opt, None)).fit()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    class Own(TinyRegressor):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    trainer = Trainer(
        Own(), base_config(tmp_path / "b", max_steps=1, lr_scheduler_type="constant"), train_dataset=regression_data(16)
    )
    trainer.fit()
    assert isinstance(trainer.optimizer, torch.optim.SGD) and trainer.get_learning_rates() == [0.5]


def test_warmup_and_schedule_reach_the_optimizer(tmp_path):
    lrs = []

    class LR(Callback):
        def on_step_begin(self, config, state, control, optimizer=None, **kw):
            lrs.append(trainer.optimizer.param_groups[0]["lr"])

    trainer = Trainer(
        TinyRegressor(),
        base_config(tmp_path, max_steps=6, warmup_steps=2, learning_rate=1.0),
        train_dataset=regression_data(64),
        callbacks=[LR()],
    )
    trainer.fit()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])


class _HookedStrategy:
    """Built lazily (the strategies package is imported by the test only): a single-device strategy
    that opts into the per-step interfaces and records their calls."""

    @staticmethod
    def make(calls: list[str]):
        import contextlib

        from kiln.strategies.interfaces import BackwardSyncControl, GraphBoundaries
        from kiln.strategies.single import SingleDeviceStrategy

        class Hooked(SingleDeviceStrategy, BackwardSyncControl, GraphBoundaries):
            def micro_batch_context(self, model, *, boundary):
                calls.append(f"context boundary={boundary}")
                return contextlib.nullcontext()

            def on_micro_batch_end(self):
                calls.append("micro_batch_end")

            def on_step_end(self):
                calls.append("step_end")

        return Hooked


def test_strategy_step_interfaces_are_called_in_order_and_only_for_strategies_that_have_them(tmp_path):
    from kiln.strategies.interfaces import BackwardSyncControl, GraphBoundaries
    from kiln.strategies.single import SingleDeviceStrategy

    calls: list[str] = []
    cfg = base_config(tmp_path, max_steps=2, gradient_accumulation_steps=2, learning_rate=1e-3)
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(32), strategy=_HookedStrategy.make(calls))
    trainer.fit()
    step = ["context boundary=False", "micro_batch_end", "context boundary=True", "micro_batch_end", "step_end"]
    assert calls == step * 2

    plain = Trainer(
        TinyRegressor(), base_config(tmp_path / "b", max_steps=2, learning_rate=1e-3), train_dataset=regression_data(32)
    )
    assert type(plain.strategy) is SingleDeviceStrategy
    assert not isinstance(plain.strategy, (BackwardSyncControl, GraphBoundaries))  # nothing to call per step
    assert not hasattr(plain.strategy, "micro_batch_context") and not hasattr(plain.strategy, "on_step_end")
    plain.fit()
    assert plain.state.global_step == 2


def test_train_output_is_hf_s_tuple_with_names_and_a_readable_repr():
    from kiln.engine.loop.fit import TrainOutput

    out = TrainOutput(7, 0.25, {"train_loss": 0.25})
    assert tuple(out) == (7, 0.25, {"train_loss": 0.25})
    assert (out.global_step, out.training_loss, out.metrics) == (7, 0.25, {"train_loss": 0.25})
    assert repr(out) == "TrainOutput(global_step=7, training_loss=0.25, metrics={'train_loss': 0.25})"


@pytest.mark.timeout(60)  # without the check, an empty stream and max_steps loop over epochs forever
def test_an_empty_iterable_dataset_is_refused_instead_of_training_nothing(tmp_path):
    class Empty(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    trainer = Trainer(TinyRegressor(), base_config(tmp_path, max_steps=3, learning_rate=1e-3), train_dataset=Empty())
    with pytest.raises(ValueError, match="iterable training dataset yielded no batches"):
        trainer.fit()


def test_throughput_and_total_flos_count_every_rank(tmp_path):
    """Every rank counts its own samples, tokens and FLOPs: throughput figures scale them by the data
    shards (each rank reads as many), state.total_flos sums them (reduce 'sum'). The second rank is
    mirrored in this process: reading its own half of the data, it counts what this one does."""
    from kiln.strategies.single import SingleDeviceStrategy

    class TwoRanks(SingleDeviceStrategy):  # rank 0 of 2 data shards; the other rank's sums equal its own
        world_size = 2

        def reduce(self, tensor, op="mean"):
            return tensor * 2 if op == "sum" else tensor

    seen = []

    class Figures(Callback):
        def on_log(self, config, state, control, logs=None, **kw):
            if "loss" in logs:
                seen.append(logs)

    model = TokenModel()
    cfg = base_config(tmp_path, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3)
    cfg["log"]["steps"] = 1
    out = Trainer(
        model, cfg, train_dataset=padded_token_data(n=8, length=12), strategy=TwoRanks, callbacks=[Figures()]
    ).fit()
    assert len(seen) == 3
    for logs in seen:  # 2 ranks x 2 samples of 12 tokens per step
        assert logs["samples_per_second"] == pytest.approx(4 * logs["steps_per_second"])
        assert logs["train_tokens_per_second"] == pytest.approx(12 * logs["samples_per_second"])
        assert logs["train_tokens_per_second_per_rank"] == pytest.approx(logs["train_tokens_per_second"] / 2)
        # 6 N per token, N without the embedding table
        per_token = 6 * sum(p.numel() for p in model.parameters() if p is not model.emb.weight)
        assert logs["train_tflops"] == pytest.approx(logs["train_tokens_per_second"] * per_token / 1e12)
        assert "mfu" not in logs  # no peak on the CPU
    m = out.metrics
    assert m["train_samples_per_second"] == pytest.approx(4 * m["train_steps_per_second"])
    assert m["train_tokens_per_second"] == pytest.approx(12 * m["train_samples_per_second"])
    per_rank = 6 * (3 * 2 * 12) * sum(p.numel() for p in model.parameters())  # 6 x tokens x parameters (HF)
    assert m["total_flos"] == pytest.approx(2 * per_rank)
