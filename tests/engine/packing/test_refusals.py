"""What data.packing refuses, each in one sentence naming the problem and the fix: models whose positions
or attention it cannot control (RoBERTa's offset positions, a TrainingModule, a model without **kwargs, a
sliding window shorter than the row), settings it cannot honour, and examples it cannot concatenate."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kiln import Trainer
from kiln.engine.data.packing import packed_training_data
from kiln.utils.errors import ConfigError
from tests.engine.packing import tiny
from tests.engine.packing.test_exactness import ONE_PROCESS, data_cfg
from tests.helpers import base_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    return tiny.model("llama")


def pack(model, examples, training_module=False, cfg=None, strategy=ONE_PROCESS, user_collator=None):
    rows, collator = packed_training_data(
        examples,
        None,
        user_collator=user_collator,
        model=model,
        training_module=training_module,
        data_cfg=cfg or data_cfg(),
        strategy=strategy,
    )
    return collator([rows[i] for i in range(len(rows))])


def test_roberta_is_refused_by_the_trainer_before_training(tmp_path):
    model = tiny.model("roberta")
    cfg = base_config(tmp_path, max_steps=1, data={"packing": {"strategy": "bfd", "max_length": 24}})
    with pytest.raises(
        ConfigError, match=r"^roberta \(RobertaForMaskedLM\) numbers its positions from padding_idx \+ 1"
    ):
        Trainer(model, cfg, train_dataset=tiny.examples("bert")).fit()


class NoKwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny.model("llama")
        self.config = self.inner.config

    def forward(self, input_ids, position_ids=None, labels=None):
        return self.inner(input_ids=input_ids, position_ids=position_ids, labels=labels)


class NoPositions(NoKwargs):
    def forward(self, input_ids, labels=None, **kwargs):
        return self.inner(input_ids=input_ids, labels=labels)


@pytest.mark.parametrize(
    "make, training_module, match",
    [
        (lambda: nn.Linear(2, 2), True, "Linear is a TrainingModule"),
        (lambda: nn.Linear(2, 2), False, "needs a Transformers model .*; Linear is not one"),
        (NoPositions, False, "NoPositions.forward takes no position_ids"),
        (NoKwargs, False, r"NoKwargs.forward takes no \*\*kwargs"),
    ],
)
def test_models_packing_cannot_reach_are_refused(make, training_module, match):
    with pytest.raises(ConfigError, match=match):
        pack(make(), tiny.examples("llama"), training_module=training_module)


def test_an_encoder_decoder_is_refused():
    import transformers as T

    cfg = T.T5Config(vocab_size=tiny.VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    with pytest.raises(ConfigError, match="T5ForConditionalGeneration is an encoder-decoder model"):
        pack(T.T5ForConditionalGeneration(cfg), tiny.examples("llama"))


def test_an_unknown_attention_implementation_is_refused(llama):
    llama.config._attn_implementation = "paged|sdpa"
    try:
        with pytest.raises(
            ConfigError, match=re.escape("attention implementation 'paged|sdpa'; data.packing supports")
        ):
            pack(llama, tiny.examples("llama"))
    finally:
        llama.config._attn_implementation = "sdpa"


def test_a_sliding_window_shorter_than_the_row_is_refused_and_one_as_long_is_kept():
    model = tiny.model("mistral")
    model.config.sliding_window = 16
    with pytest.raises(ConfigError, match="sliding window of 16 tokens, shorter than data.packing.max_length=24"):
        pack(model, tiny.examples("mistral"))
    batch = pack(model, tiny.examples("mistral"), cfg=data_cfg(max_length=16))
    assert batch["max_length_q"] <= 16


def test_context_parallel_is_left_to_the_strategy(llama):
    """Under cp (item shards beyond the data shards) the rows are packed as on one process: the mesh
    strategy splits them and masks each example (tests/strategies/model_parallel/test_cp_packing.py)."""
    cp2 = SimpleNamespace(data_shards=2, data_shard_rank=0, item_shards=4)
    batch = pack(llama, tiny.examples("llama"), strategy=cp2)
    assert "cu_seq_lens_q" in batch and batch["position_ids"].eq(0).sum() > batch["input_ids"].shape[0]


@pytest.mark.parametrize(
    "cfg, strategy, collator, match",
    [
        (
            data_cfg(strategy="best"),
            ONE_PROCESS,
            None,
            r"data.packing.strategy is 'best'; choose bfd, bfd_split or wrapped",
        ),
        (data_cfg(max_length=0), ONE_PROCESS, None, r"data.packing.max_length is 0; give the packed row's length"),
        (data_cfg(), ONE_PROCESS, lambda items: items, "the data_collator passed \\(function\\) would not be used"),
        (data_cfg(group_by_length=True), ONE_PROCESS, None, "drop group_by_length"),
        (
            data_cfg(dispatch_batches=True),
            SimpleNamespace(data_shards=2, data_shard_rank=0, item_shards=2),
            None,
            "drop dispatch_batches",
        ),
    ],
)
def test_settings_packing_cannot_honour_are_refused(llama, cfg, strategy, collator, match):
    with pytest.raises(ConfigError, match=match):
        pack(llama, tiny.examples("llama"), cfg=cfg, strategy=strategy, user_collator=collator)


@pytest.mark.parametrize(
    "example, match",
    [
        ([1, 2, 3], "example 0 is a list without input_ids"),
        ({"input_ids": [1, 2], "attention_mask": [1, 0]}, "example 0 is padded"),
        (
            {"input_ids": [1, 2], "position_ids": [0, 1]},
            "example 0 has 'position_ids', which data.packing computes itself",
        ),
        (
            {"input_ids": [1, 2], "labels": 1},
            r"'labels' of example 0 has shape \(\), not one entry per token \(2, as input_ids\)",
        ),
        ({"input_ids": [[1, 2]]}, r"'input_ids' of example 0 has shape \(1, 2\)"),
        ({"input_ids": ["a"]}, "'input_ids' of example 0 has a value"),
    ],
)
def test_examples_packing_cannot_concatenate_are_refused(llama, example, match):
    with pytest.raises(ConfigError, match=match):
        pack(llama, [example, {"input_ids": [1, 2, 3]}])


def test_examples_with_different_keys_in_one_row_are_refused(llama):
    with pytest.raises(ConfigError, match="put examples with different keys in one row"):
        pack(llama, [{"input_ids": [1, 2]}, {"input_ids": [3, 4], "labels": [3, 4]}])


def test_an_all_ones_attention_mask_is_dropped_and_labels_come_from_input_ids(llama):
    batch = pack(
        llama,
        [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}, {"input_ids": [8, 9]}],
        cfg=data_cfg(padding_free=True),
    )
    assert "attention_mask" not in batch
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and batch["max_length_q"] == 3


def test_padding_rows_restart_positions_and_are_a_piece_of_their_own(llama):
    batch = pack(llama, [{"input_ids": [5] * 10}, {"input_ids": [6] * 24}], cfg=data_cfg(padding_free=False))
    assert batch["input_ids"].shape == (2, 24)
    short = 0 if batch["input_ids"][0, -1] == 0 else 1
    assert batch["position_ids"][short].tolist() == list(range(10)) + list(range(14))
    assert batch["labels"][short, 10:].eq(-100).all()
    assert sorted(torch.diff(batch["cu_seq_lens_q"]).tolist()) == [10, 14, 24]


def test_padding_free_without_a_strategy_concatenates_the_micro_batch_unpacked(llama):
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    rows, collator = packed_training_data(
        examples,
        None,
        user_collator=None,
        model=llama,
        training_module=False,
        data_cfg=data_cfg(strategy=None, padding_free=True),
        strategy=ONE_PROCESS,
    )
    assert rows is examples
    batch = collator(examples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
