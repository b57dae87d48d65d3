"""total_flos as HF counts it (kiln/engine/loop/flops.py): 6 x the main input's elements x the parameters that
are not embeddings, for models with `num_parameters`; a model's own `floating_point_ops`; kiln's count for other
models; nothing for batches without the main input."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from kiln.engine.loop.flops import FlopCount


class Vision(nn.Module):
    """Stands in for a Transformers vision model: its main input is `pixel_values`."""

    main_input_name = "pixel_values"

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 3), nn.Linear(3, 2)  # 15 and 8 parameters

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        return 8 if exclude_embeddings else 23


def test_a_model_with_num_parameters_counts_its_main_input_without_embeddings():
    count = FlopCount(Vision())
    assert count.count({"pixel_values": torch.zeros(2, 3, 4), "input_ids": torch.zeros(9)}) == 6 * 24 * 8
    assert count.count({"input_ids": torch.zeros(9)}) == 0.0  # HF's estimate_tokens: no main input, no count
    assert count.count((torch.zeros(2),)) == 0.0


def test_a_gpt2_is_counted_as_hfs_trainer_counts_it():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    )
    batch = {"input_ids": torch.zeros(3, 8, dtype=torch.long), "labels": torch.zeros(3, 8, dtype=torch.long)}
    hf = transformers.Trainer.floating_point_ops(types.SimpleNamespace(model=model), batch)
    assert FlopCount(model).count(batch) == hf == 6 * 24 * model.num_parameters(exclude_embeddings=True)


def test_a_models_own_count_is_asked_for_every_batch():
    class Own(nn.Linear):
        def floating_point_ops(self, inputs):
            return 7 * len(inputs)

    count = FlopCount(Own(2, 2))
    assert count.count({"a": 1, "b": 2}) == 14.0 and count.count({}) == 0.0


def test_another_model_counts_every_parameter_per_input_id():
    count = FlopCount(nn.Linear(4, 2))  # 10 parameters
    assert count.count({"input_ids": torch.zeros(3, 5)}) == 6 * 15 * 10
    assert count.count({"x": torch.zeros(3)}) == 0.0


def test_transformers_4s_stock_count_is_replaced_by_the_rule_worked_out_once(monkeypatch):
    """Transformers 4.x models inherit ModuleUtilsMixin.floating_point_ops, which walks every parameter per call:
    the same count, so kiln uses the rule instead of calling it each micro-batch."""
    calls = []

    class Mixin:
        def floating_point_ops(self, inputs):
            calls.append(1)
            return 6 * inputs["input_ids"].numel() * self.num_parameters(exclude_embeddings=True)

    class Old(Mixin, Vision):
        main_input_name = "input_ids"

    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", types.SimpleNamespace(ModuleUtilsMixin=Mixin))
    count = FlopCount(Old())
    assert count.own is None and count.count({"input_ids": torch.zeros(4)}) == 6 * 4 * 8 and not calls


class SummingRanks:
    """A strategy of `ranks` processes, each holding what this one holds: a sum over ranks multiplies."""

    def __init__(self, ranks: int, item_shards: int, data_shards: int | None = None) -> None:
        self.world_size, self.item_shards, self.root_device, self.ops = ranks, item_shards, torch.device("cpu"), []
        self.data_shards = item_shards if data_shards is None else data_shards

    def reduce(self, tensor, op):
        self.ops.append(op)
        return tensor * self.world_size


@pytest.mark.parametrize("ranks, data_shards", [(1, 1), (2, 2), (2, 1)])
def test_the_window_flos_and_tokens_seen_are_summed_over_the_ranks_that_hold_distinct_data(ranks, data_shards):
    """(2, 1) is cp 2 on one data shard: each rank steps on its chunk of the rows, padded so the split divides
    them (5 tokens -> 6, 3 a rank); num_input_tokens_seen counts the rows as loaded, once: 10, not 12."""
    from types import SimpleNamespace

    from kiln.engine.loop.fit_meter import FitMeter

    meter = FitMeter.__new__(FitMeter)  # only the counters under test: no model, no accelerator
    meter.strategy = strategy = SummingRanks(ranks, item_shards=ranks, data_shards=data_shards)
    meter.local_flos, meter.count_tokens_seen = 3.0, True
    state = SimpleNamespace(total_flos=10.0, num_input_tokens_seen=0)
    meter.flush_flos(state)
    assert state.total_flos == 10.0 + 3.0 * ranks and meter.local_flos == 0.0
    meter.samples = meter.tokens = 0
    meter.flops = meter.throughput = SimpleNamespace(count=lambda batch: 0.0)
    loaded = [{"input_ids": torch.zeros(2, 5, dtype=torch.long)}]
    split = ranks // data_shards
    stepped = [{"input_ids": torch.zeros(2, 6 // split if split > 1 else 5, dtype=torch.long)}]
    meter.count(stepped, state, loaded)
    assert state.num_input_tokens_seen == 10 * data_shards and meter.samples == 2
    assert meter.tokens == stepped[0]["input_ids"].numel()  # throughput's tokens: the chunk the rank stepped on
    assert strategy.ops == ["sum", "sum"][: 2 * (ranks > 1)]  # one process reads nothing across ranks
