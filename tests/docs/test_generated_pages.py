"""docs/choosing-a-strategy.md, docs/troubleshooting.md and the format table of docs/checkpoints.md are generated from the code; they must be
current, and the generators must read what the code says."""

from __future__ import annotations

import textwrap

import pytest

from kiln.docgen.__main__ import pages
from kiln.docgen.errors_page import raise_sites, troubleshooting_markdown
from kiln.docgen.format_table import format_rows
from kiln.docgen.strategy_matrix import load_runs, verdict
from kiln.strategies.capabilities import Capabilities
from tests.docs.blocks import REPO


@pytest.mark.parametrize("name", ["choosing-a-strategy.md", "troubleshooting.md", "checkpoints.md"])
def test_generated_page_is_current(name):
    path = REPO / "docs" / name
    assert path.read_text() == pages(REPO)[path], f"docs/{name} is stale: run `python -m kiln.docgen`"


class _Narrow:
    name = "narrow"
    capabilities = Capabilities(devices=frozenset({"cpu"}), precisions=frozenset({"fp32"}),
                                reasons={"bf16": "it has no autocast"})


def test_a_cell_quotes_the_compatibility_check():
    assert verdict("narrow", _Narrow, "fp32", "cpu") == "trains"
    assert verdict("narrow", _Narrow, "bf16", "cpu") == \
        "refused: strategy 'narrow' cannot train with precision 'bf16': it has no autocast."
    assert verdict("narrow", _Narrow, "fp32", "cuda").startswith("refused: strategy 'narrow' cannot run on 'cuda'")


def test_the_page_shows_each_registered_strategys_refusals():
    text = (REPO / "docs" / "choosing-a-strategy.md").read_text()
    assert "| cpu | `apex` | refused: strategy 'fsdp' cannot train with precision 'apex'" in text
    assert "| mps | any | refused: strategy 'ddp' cannot run on 'mps'" in text
    assert "| cpu | `fp32` | trains | CI, 2 gloo processes (`tests/distributed/test_ddp_parity.py`) |" in text


def test_a_hardware_record_with_an_unknown_name_is_refused(tmp_path):
    (tmp_path / "docs" / "_data").mkdir(parents=True)
    (tmp_path / "docs" / "_data" / "hardware_runs.yaml").write_text(
        "runs:\n  - {strategy: dpp, device: cpu, precisions: [fp32], hardware: x, evidence: y}\n")
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['dpp'\]"):
        load_runs(tmp_path)


def test_every_raise_with_a_message_is_listed(tmp_path):
    pkg = tmp_path / "kiln"
    (pkg / "precision").mkdir(parents=True)
    (pkg / "precision" / "x.py").write_text(textwrap.dedent('''
        from kiln.utils.errors import PrecisionError
        def check(name, ok):
            def inner():
                raise ValueError("inner " + f"{name!r} bad")
            if not ok:
                raise PrecisionError(f"precision {name!r} needs a GPU; "
                                     "use bf16.") from None
            raise SystemExit(2)
    '''))
    sites = {(s.section, s.error, s.message, s.where) for s in raise_sites(pkg)}
    assert sites == {("Precision", "PrecisionError", "precision {name} needs a GPU; use bf16.", "kiln/precision/x.py:check"),
                     ("Precision", "ValueError", "inner {name} bad", "kiln/precision/x.py:inner")}
    assert "| `PrecisionError` | precision {name} needs a GPU; use bf16. | `kiln/precision/x.py:check` |" in \
        troubleshooting_markdown(pkg)


def test_the_format_table_reads_what_the_checkpoint_ios_say():
    rows = {row["format"]: row for row in format_rows()}
    assert rows["full"]["written"] == ["ddp", "mps", "single"] and rows["full"]["background"]
    assert rows["model-parallel-dcp"]["written"] == [] and rows["model-parallel-dcp"]["resumed"] == ["fsdp", "model_parallel"]
    assert not rows["deepspeed"]["reshardable"] and rows["deepspeed"]["resumed"] == ["deepspeed"]
    assert not rows["xla-full"]["background"]  # it saves otherwise than the full format, so it cannot stage
    assert all(row["convert"] for row in rows.values())
