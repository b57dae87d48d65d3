"""`train_sampling_strategy="group_by_length"` against HF's Trainer: HF's megabatch order
(`get_length_grouped_indices`), lengths read from a `datasets.Dataset`'s `length_column_name` column, and
the column looked for after `remove_unused_columns` (so with GPT-2, which takes no `length`, only
remove_unused_columns=false uses it, in HF as in kiln). HF draws the permutation from the global RNG; the
HF run here is given kiln's generator (seed + epoch 0) so that both orders can be compared batch for batch."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.engine.data.length_grouping import LengthGroupedSampler, length_grouped_indices
from tests.engine.hf_compare import gpt2, hf_args, kiln_config, max_diff, token_rows

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

SEED, ROWS = 42, 32


def _data():
    cols = token_rows(ROWS)
    g = torch.Generator().manual_seed(9)
    # every row has 8 tokens: the order can only follow the column (distinct values, no ties)
    cols["length"] = (torch.randperm(ROWS, generator=g) + 1).tolist()
    return datasets.Dataset.from_dict({k: cols[k] for k in ("input_ids", "labels", "length")})


def _collate(features):  # the model's inputs only (remove_unused_columns=false leaves `length` in the items)
    return {k: torch.tensor([f[k] for f in features]) for k in ("input_ids", "labels")}


@pytest.mark.parametrize("remove", [False, True], ids=["column-used", "column-removed-first"])
def test_group_by_length_reads_the_column_as_hf_does(tmp_path, remove):
    data, seen = _data(), {"hf": [], "kiln": []}

    class HF(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            sampler = super()._get_train_sampler(train_dataset)
            sampler.generator = torch.Generator().manual_seed(SEED)  # kiln's draw for epoch 0
            return sampler

        def training_step(self, model, inputs, num_items_in_batch=None):
            seen["hf"].append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, num_items_in_batch)

    class Kiln(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None, micro_batch=None):
            seen["kiln"].append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, num_items_in_batch, micro_batch)

    kw = dict(
        train_sampling_strategy="group_by_length",
        length_column_name="length",
        remove_unused_columns=remove,
        gradient_accumulation_steps=2,
        max_steps=6,
    )
    theirs, ours = gpt2(), gpt2()
    HF(
        model=theirs, args=hf_args(str(tmp_path / "hf"), seed=SEED, **kw), train_dataset=data, data_collator=_collate
    ).train()
    Kiln(ours, kiln_config(tmp_path, seed=SEED, **kw), train_dataset=data, data_collator=_collate).fit()
    assert len(seen["kiln"]) == len(seen["hf"]) == 12
    assert all(torch.equal(a, b) for a, b in zip(seen["kiln"], seen["hf"]))
    assert max_diff(ours, theirs) < 2e-5
    first = [row for row in range(ROWS) if data[row]["input_ids"] == seen["kiln"][0][0].tolist()][0]
    assert (data[first]["length"] == ROWS) is not remove  # the longest row comes first when the column counts


def test_the_order_is_hfs_length_grouped_indices():
    from transformers.trainer_pt_utils import get_length_grouped_indices

    g = torch.Generator().manual_seed(0)
    for n, group in [(1000, 10), (37, 4), (5, 8)]:
        lengths = torch.randint(1, 50, (n,), generator=g).tolist()
        ours = length_grouped_indices(lengths, group, torch.Generator().manual_seed(n))
        assert ours == get_length_grouped_indices(lengths, group, generator=torch.Generator().manual_seed(n))
        sampler = LengthGroupedSampler(lengths, batch_size=group, seed=n)
        assert list(sampler) == ours and lengths[ours[0]] == max(lengths)


def test_the_longest_sample_moves_to_the_front_from_a_later_megabatch():
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = (torch.randperm(400, generator=torch.Generator().manual_seed(3)) + 1).tolist()  # distinct: no ties
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(1)).tolist()
    assert lengths.index(400) not in perm[:100]  # 4 megabatches of 100: the longest starts outside the first
    ours = length_grouped_indices(lengths, 10, g)
    assert ours == get_length_grouped_indices(lengths, 10, generator=torch.Generator().manual_seed(1))
    assert lengths[ours[0]] == 400


def test_lengths_come_from_the_column_key_or_the_inputs_and_else_one_clear_error():
    from kiln.engine.data.length_grouping import sample_lengths
    from kiln.utils.errors import ConfigError

    assert sample_lengths([{"length": 3, "input_ids": [1]}, {"input_ids": [1, 2]}], "length") == [3, 2]
    assert sample_lengths([{"tokens": [1, 2, 3]}], "length", input_name="tokens") == [3]
    with pytest.raises(ConfigError, match="sample 1 is a dict without either"):
        sample_lengths([{"input_ids": [1]}, {"x": 1}], "length")
    with pytest.raises(ConfigError, match="sample 0 is a tuple"):
        sample_lengths([(1, 2)], "length")
