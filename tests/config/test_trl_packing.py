"""TRL's SFTConfig names for packing load onto data.packing: `packing` (with `packing_strategy`, which
alone means nothing, as in TRL), `padding_free`, and `max_length` / `max_seq_length` as the row length
when packing; without packing TRL's truncation length is dropped with a warning, not read as a row length."""

from __future__ import annotations

import pytest

from kiln.config import ConfigError, load_config


def packing(tmp_path, **raw):
    return dict(load_config({"output_dir": str(tmp_path), **raw}).data.packing)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({}, {"strategy": None, "max_length": 1024, "padding_free": None}),
        ({"packing": True}, {"strategy": "bfd", "max_length": 1024, "padding_free": None}),
        ({"packing": "true", "max_length": 512}, {"strategy": "bfd", "max_length": 512, "padding_free": None}),
        (
            {"packing": True, "packing_strategy": "wrapped", "max_seq_length": 64},
            {"strategy": "wrapped", "max_length": 64, "padding_free": None},
        ),
        (
            {"packing": True, "packing_strategy": "bfd_split", "padding_free": "false"},
            {"strategy": "bfd_split", "max_length": 1024, "padding_free": False},
        ),
        (
            {"packing": False, "packing_strategy": "wrapped"},
            {"strategy": None, "max_length": 1024, "padding_free": None},
        ),
        ({"padding_free": True}, {"strategy": None, "max_length": 1024, "padding_free": True}),
        ({"eval_packing": False, "padding_free": None}, {"strategy": None, "max_length": 1024, "padding_free": None}),
        (
            {"data": {"packing": {"strategy": "wrapped", "max_length": 8}}},
            {"strategy": "wrapped", "max_length": 8, "padding_free": None},
        ),
    ],
)
def test_trl_names_load_onto_data_packing(tmp_path, raw, expected):
    assert packing(tmp_path, **raw) == expected


def test_a_length_without_packing_is_dropped_with_a_warning(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        assert packing(tmp_path, max_length=12)["max_length"] == 1024
    assert "max_length=12 has no effect without packing" in caplog.text


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"packing": "bogus"}, r"'bogus' is not a packing strategy \(packing / packing_strategy\); choose one of bfd"),
        ({"packing": True, "packing_strategy": "first_fit"}, "'first_fit' is not a packing strategy"),
        ({"packing": True, "max_length": None}, "packing needs max_length"),
        ({"eval_packing": True}, "kiln packs training data only"),
    ],
)
def test_values_packing_cannot_take_are_refused(tmp_path, raw, match):
    with pytest.raises(ConfigError, match=match):
        packing(tmp_path, **raw)
