"""HF options that HF itself accepts and ignores (issue 30 item 5): kiln accepts them with any value
and, switched on, says in one log line that they have no effect."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from kiln.config import load_config


def _plain(cfg):
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("value", [True, "true", 1])
def test_sortish_sampler_is_accepted_with_one_log_line(tmp_path, caplog, value):
    with caplog.at_level(logging.INFO, logger="kiln"):
        cfg = load_config({"output_dir": str(tmp_path), "sortish_sampler": value})
    lines = [r.getMessage() for r in caplog.records if "sortish_sampler" in r.getMessage()]
    assert len(lines) == 1 and "has no effect" in lines[0] and "group_by_length" in lines[0]
    assert _plain(cfg) == _plain(load_config({"output_dir": str(tmp_path)}))  # nothing else changes


@pytest.mark.parametrize("value", [False, None, "false"])
def test_sortish_sampler_off_says_nothing(tmp_path, caplog, value):
    with caplog.at_level(logging.INFO, logger="kiln"):
        load_config({"output_dir": str(tmp_path), "sortish_sampler": value})
    assert not [r for r in caplog.records if "sortish_sampler" in r.getMessage()]


def test_hf_seq2seq_arguments_accept_it_too():
    transformers = pytest.importorskip("transformers")
    args = transformers.Seq2SeqTrainingArguments(output_dir="unused", sortish_sampler=True, report_to="none")
    assert args.sortish_sampler is True
