"""HF boolean options given as strings mean what the string says: "false", "False" and "0" are off.

A YAML file with a quoted value, accelerate's JSON accelerator_config written by hand, or a CLI override
all hand kiln the *string*; `bool("false")` is True, so a truthiness test would switch the option on.
Each key is checked against its kiln default in both directions, so the result cannot come from the
default alone."""

from __future__ import annotations

import json

import pytest

from kiln.config.load import load_config
from kiln.utils.errors import ConfigError

#: HF accelerator_config key -> where kiln keeps it
ACCELERATOR = {
    "split_batches": "data.split_batches",
    "dispatch_batches": "data.dispatch_batches",
    "even_batches": "data.even_batches",
}
FALSE, TRUE = ("false", "False", "0", " FALSE "), ("true", "True", "1")


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


@pytest.mark.parametrize("text,want", [(t, False) for t in FALSE] + [(t, True) for t in TRUE])
def test_accelerator_config_strings(text, want, tmp_path):
    mapping = {key: text for key in ACCELERATOR}
    path = tmp_path / "accelerator.json"
    path.write_text(json.dumps(mapping))
    for source in (mapping, str(path)):  # a mapping, or the JSON file HF also accepts
        cfg = load_config({"accelerator_config": source})
        assert {key: _get(cfg, dotted) for key, dotted in ACCELERATOR.items()} == dict.fromkeys(ACCELERATOR, want)


@pytest.mark.parametrize("text,want", [(t, False) for t in FALSE] + [(t, True) for t in TRUE])
def test_flat_legacy_names_and_ddp_static_graph_from_a_yaml_file(text, want, tmp_path):
    path = tmp_path / "run.yaml"
    lines = [f'{key}: "{text}"' for key in ACCELERATOR] + [f'ddp_static_graph: "{text}"']
    path.write_text("\n".join(lines) + "\n")
    cfg = load_config(str(path))
    assert {key: _get(cfg, dotted) for key, dotted in ACCELERATOR.items()} == dict.fromkeys(ACCELERATOR, want)
    assert cfg.strategy.static_graph is want


@pytest.mark.parametrize("text,want", [("false", False), ("'false'", False), ("0", False), ("true", True)])
def test_ddp_static_graph_from_a_command_line_override(text, want):
    """`kiln fit run.yaml ddp_static_graph=false` (quoted: the string survives the dotlist parser)."""
    assert load_config({}, [f"ddp_static_graph={text}"]).strategy.static_graph is want
    assert load_config({}, [f"even_batches={text}"]).data.even_batches is want


@pytest.mark.parametrize("text", FALSE)
def test_use_seedable_sampler_false_as_a_string_is_read_as_false(text):
    """kiln refuses use_seedable_sampler=false (see validate.py); the refusal proves the string was read
    as False. "true" is kiln's behaviour and is accepted."""
    for source in ({"accelerator_config": {"use_seedable_sampler": text}}, {"use_seedable_sampler": text}):
        with pytest.raises(ConfigError, match="use_seedable_sampler=false"):
            load_config(source)
    assert load_config({"accelerator_config": {"use_seedable_sampler": "true"}}).data.use_seedable_sampler is True
