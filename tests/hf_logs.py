"""HF's warnings as caplog sees them. kiln gives a few of HF's own warnings on HF's logger names when
transformers is imported (kiln.utils.hf_logging), and transformers' root logger does not propagate to
the root logger that caplog listens on; `hf_propagation` lets it while a test runs. Which logger a
warning went to depends on whether some earlier test imported transformers: `records` takes either."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def hf_propagation():
    root = logging.getLogger("transformers")  # never imports transformers
    saved = root.propagate
    root.propagate = True
    yield
    root.propagate = saved


def records(caplog, kiln_logger: str, hf_logger: str) -> list[logging.LogRecord]:
    """The WARNING records of `kiln_logger` or `hf_logger`."""
    return [r for r in caplog.records if r.name in (kiln_logger, hf_logger) and r.levelno == logging.WARNING]
