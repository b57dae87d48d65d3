"""Micro-batch loss weights: the global mean over the items of every rank (the default, HF's
average_tokens_across_devices) or each rank's own mean, and when the item-count all-reduce runs."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.engine.loop.loss_weights import WindowWeights
from tests.helpers import TokenModel, base_config, padded_token_data, train_step_of


def test_global_mean_waits_for_the_reduced_count_lazily_and_once():
    calls = []

    def wait():
        calls.append(1)
        return torch.tensor(20)

    w = WindowWeights([torch.tensor(3), torch.tensor(5)], 2, wait, global_mean=True, model_divides=False)
    assert calls == []  # nothing waits before the first weight is needed (after the first forward)
    assert float(w.weight(0)) == pytest.approx(3 * 2 / 20) and float(w.weight(1)) == pytest.approx(5 * 2 / 20)
    assert int(w.total) == 20 and calls == [1]


def test_rank_mean_weights_by_local_counts():
    local = torch.tensor(8)
    w = WindowWeights([torch.tensor(3), torch.tensor(5)], 1, lambda: local, global_mean=False, model_divides=False)
    assert [float(w.weight(i)) for i in (0, 1)] == pytest.approx([3 / 8, 5 / 8])


@pytest.mark.parametrize("global_mean, scale, expected", [(True, 2, 2), (False, 1, None)])
def test_models_that_divide_by_num_items_get_only_the_dp_factor(global_mean, scale, expected):
    w = WindowWeights([torch.tensor(3)], scale, lambda: torch.tensor(9), global_mean=global_mean, model_divides=True)
    assert w.weight(0) == expected


@pytest.mark.parametrize("average, shards", [(True, 2), (False, 2), (True, 1)])
def test_trainer_reduces_item_counts_only_for_the_global_mean(tmp_path, monkeypatch, average, shards):
    data = padded_token_data(n=8)
    cfg = base_config(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        average_tokens_across_devices=average,
    )
    trainer = Trainer(TokenModel(), cfg, train_dataset=data)
    reduced = []

    def reduce_async(tensor, op="sum"):
        reduced.append(int(tensor))
        return lambda: tensor * shards  # what the other ranks with the same counts would add

    monkeypatch.setattr(type(trainer.strategy), "data_shards", property(lambda self: shards))
    monkeypatch.setattr(type(trainer.strategy), "grad_divisor", property(lambda self: shards))
    monkeypatch.setattr(trainer.strategy, "reduce_async", reduce_async)
    window = [torch.utils.data.default_collate(data[i : i + 2]) for i in (0, 2)]
    counts = [int(b["labels"].ne(-100).sum()) for b in window]
    weights = train_step_of(trainer).loss_weights(window)
    got = [float(weights.weight(i)) for i in (0, 1)]
    if average and shards > 1:
        assert reduced == [sum(counts)]
        assert got == pytest.approx([c * 2 / (2 * sum(counts)) for c in counts])
    else:  # each shard's own mean; one shard's is the global one, with no collective per step
        assert reduced == []
        assert got == pytest.approx([c / sum(counts) for c in counts])


def test_an_accumulated_window_has_the_gradient_of_one_batch_of_all_its_items(tmp_path):
    """Each micro-batch's loss is weighted by its share of the window's items (Trainer.training_step
    reads MicroBatch.weight), so two micro-batches with different token counts step like one batch."""
    from kiln.engine.loop.loss_weights import MicroBatch
    from kiln.engine.run import setup_for_eval

    data = padded_token_data(n=4)
    cfg = base_config(tmp_path, max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = Trainer(TokenModel(), cfg, train_dataset=data)
    model, params = setup_for_eval(trainer.run, trainer.strategy, trainer.config), list(trainer.model.parameters())
    window = [torch.utils.data.default_collate(data[i : i + 2]) for i in (0, 2)]
    assert window[0]["labels"].ne(-100).sum() != window[1]["labels"].ne(-100).sum()  # unequal: weights matter
    weights = train_step_of(trainer).loss_weights(window)
    for i, batch in enumerate(window):
        trainer.training_step(model, batch, micro_batch=MicroBatch(i, i == 1, weights))
    accumulated = [p.grad.clone() for p in params]
    trainer.model.zero_grad(set_to_none=True)
    trainer.training_step(model, torch.utils.data.default_collate(data), micro_batch=MicroBatch(0, True, None))
    for got, whole in zip(accumulated, [p.grad for p in params], strict=True):
        torch.testing.assert_close(got, whole)


def test_a_lone_micro_batch_on_several_shards_is_weighted_by_the_global_count(tmp_path, monkeypatch):
    """Without accumulation, a shard's mean loss still needs its share of the global items when the
    shards' counts differ: training_step gets micro_batch.weight = n x d / N, not an unweighted loss."""
    seen = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append((self.run.micro_batch.weight, int(inputs["labels"].ne(-100).sum())))
            return super().training_step(model, inputs, num_items_in_batch)

    cfg = base_config(tmp_path, max_steps=1, per_device_train_batch_size=2)
    trainer = Recording(TokenModel(), cfg, train_dataset=padded_token_data(n=4))
    monkeypatch.setattr(type(trainer.strategy), "data_shards", property(lambda self: 2))
    monkeypatch.setattr(type(trainer.strategy), "grad_divisor", property(lambda self: 2))
    monkeypatch.setattr(
        trainer.strategy, "reduce_async", lambda tensor, op="sum": lambda: tensor + 10
    )  # the other shard: 10
    trainer.fit()
    [(weight, n)] = seen
    assert float(weight) == pytest.approx(n * 2 / (n + 10))
