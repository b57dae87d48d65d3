import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Tests never need more than the 2 cores of the CI machine; fewer threads keeps timings stable.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import logging  # noqa: E402

import pytest  # noqa: E402


def _levels_put_back():
    names = ("kiln", "transformers")
    saved = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(autouse=True)
def _restore_log_levels():
    """A Trainer applies `log.level` to the process-wide `kiln` (and `transformers`) loggers, as HF
    does; put them back so that one test's quiet config cannot hide another test's warnings."""
    yield from _levels_put_back()


@pytest.fixture(autouse=True, scope="module")
def _restore_log_levels_after_module_fixtures():
    """The same around a module's fixtures: a module-scoped fixture that trains runs before the
    per-test guard saves the levels (autouse fixtures of a scope run before its other fixtures)."""
    yield from _levels_put_back()
