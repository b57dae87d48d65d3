"""The documentation site builds in MkDocs' strict mode: a broken link or anchor, a page missing from
the nav, an API entry that names nothing, or a docstring mkdocstrings cannot read fails the build."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_the_api_page_covers_every_exported_name():
    import kiln

    entries = set(re.findall(r"^::: ([\w.]+)$", (REPO / "docs" / "api.md").read_text(), re.M))
    wanted = {f"{getattr(kiln, name).__module__}.{name}" for name in kiln.__all__}
    assert wanted - entries == set(), f"docs/api.md lacks exported names: {sorted(wanted - entries)}"
    assert entries - wanted == set(), f"docs/api.md documents names kiln does not export: {sorted(entries - wanted)}"


def test_the_versioning_page_lists_every_exported_name():
    import kiln

    text = (REPO / "docs" / "versioning.md").read_text()
    listed = text[text.index("**The names `kiln/__init__.py` exports**"):text.index("- **Config keys**")]
    assert set(re.findall(r"`(\w+)`", listed)) - {"__init__"} == set(kiln.__all__), \
        "docs/versioning.md's list of public names differs from kiln.__all__"
