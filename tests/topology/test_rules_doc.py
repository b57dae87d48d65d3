"""docs/contributing.md's "Topology rules and their tests" names, beside each rule, the tests that hold
kiln to it: every one named there must exist (a renamed or deleted test would leave a rule untested
while the page still says otherwise)."""

from __future__ import annotations

import re

from tests.docs.blocks import REPO

SECTION = "## Topology rules and their tests"


def _named_tests() -> list[tuple[str, str]]:
    page = (REPO / "docs" / "contributing.md").read_text()
    assert SECTION in page
    section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", section)


def test_every_test_the_topology_rules_name_exists():
    named = _named_tests()
    assert len(named) >= 20
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not re.search(rf"^def {name}\(", (REPO / path).read_text(), re.MULTILINE)
    ]
    assert not missing, f"docs/contributing.md names tests that do not exist: {missing}"
