import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Tests never need more than the 2 cores of the CI machine; fewer threads keeps timings stable. Under
# pytest-xdist two workers share those cores: one thread each (and for the processes they start), since
# oversubscribed intra-op threads spin and slow everything down.
os.environ.setdefault("OMP_NUM_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")

from tests import schedule  # noqa: E402
from tests.jit_ops import use_own_extensions_dir  # noqa: E402

# DeepSpeed's CPU-Adam op is JIT-built into a folder of this environment's own, inherited by every process
# a test starts: torch's shared default folder is rebuilt (minutes) whenever another environment used it.
use_own_extensions_dir()

import gc  # noqa: E402
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


def _replay_line(config) -> str | None:
    """pytest-randomly (the test extra) runs the files, and the tests in each, in a random order, so that a
    test that passes only after another one shows up. Its seed is printed in the header, which `-q` (the
    README's command) hides; this line says it instead, at the start (it survives a run that hangs) and
    at the end (beside the failures)."""
    seed = getattr(config.option, "randomly_seed", None)
    if not isinstance(seed, int) or hasattr(config, "workerinput"):  # -p no:randomly, or an xdist worker
        return None
    return f"random test order: replay it with --randomly-seed={seed} (or turn it off with -p no:randomly)"


def _seed_torch(seed: int) -> None:
    """torch's share of pytest-randomly's reseeding before each test, without importing anything: a test
    may have taken torch out of sys.modules for the moment (tests/engine/test_default_optimizer.py)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "manual_seed"):
        torch.manual_seed(seed % 2**63)


def pytest_configure(config):
    """pytest-randomly reseeds `random` and numpy before each test's setup, call and teardown, and calls
    every installed package's `pytest_randomly.random_seeder` entry point too. DeepSpeed registers one
    that seeds torch, but loading it imports DeepSpeed, and with it mlflow, pandas and scipy, into every
    test process: seconds of start-up, and modules a test may not expect to be there. Its torch seeding
    is kept (each test then starts from the same torch RNG in any order), without the imports."""
    if hasattr(config.option, "loadscopereorder"):  # xdist: hand out the files in collection order
        config.option.loadscopereorder = False
    try:
        import pytest_randomly
    except ImportError:
        return
    if getattr(pytest_randomly, "entrypoint_reseeds", ()) is None:  # not loaded yet: loaded at the first reseed
        pytest_randomly.entrypoint_reseeds = [_seed_torch]


def pytest_collection_finish(session):
    """What collection built (torch, Transformers, every test module: ~0.5 M objects) lives until the
    process ends. Freezing it keeps the garbage collector from walking it again in every full collection:
    kiln, accelerate and the tests call gc.collect() at each process-group teardown, memory stage and
    batch-size retry, and each such call took ~0.5 s, and seconds late in an xdist worker. What the tests
    create afterwards is collected as before."""
    gc.collect()  # collection's own garbage first: frozen objects are never freed
    gc.freeze()


def pytest_sessionstart(session):
    line = _replay_line(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = _replay_line(config)
    if line:
        terminalreporter.write_line(line)


#: test files whose tests share one session/package-scoped job and so must run in one xdist worker
_SHARED_GROUPS = {
    "tests/strategies/fsdp/test_generate.py": "fsdp-shared-job",
    "tests/strategies/fsdp/test_loading.py": "fsdp-shared-job",
    "tests/strategies/fsdp/test_precision.py": "fsdp-shared-job",
    "tests/launch/test_ray_train.py": "ray",
    "tests/launch/test_ray_tune.py": "ray",
    "tests/launch/test_ray_output_once.py": "ray",
}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def group_of_path(path: str) -> str:
    """The xdist group of a test file, by its path relative to the repository."""
    return _SHARED_GROUPS.get(path, path)


def _group_of(item) -> str:
    """The item's xdist group: its file's own `pytestmark` may name one (files sharing a spawned world)."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return mark.args[0] if mark.args else mark.kwargs["name"]
    return group_of_path(os.path.relpath(str(item.path), _ROOT).replace(os.sep, "/"))


def pytest_itemcollected(item):
    """Under `pytest -n 2 --dist loadgroup` a file is the unit handed to a worker (its module-scoped
    fixtures train once), and files that share a session-scoped job go together. Marked as each item
    is collected: xdist reads the mark in its own collection hook, which may run before a conftest's."""
    if item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group(_group_of(item)))  # the file's path, or its _SHARED_GROUPS name


def pytest_collection_modifyitems(config, items):
    """Slowest groups first (Ray and DeepSpeed a couple of minutes in) and the XLA suite last
    (tests/schedule.py says why). It runs after
    pytest-randomly's shuffle (a wrapper), and xdist is told to keep this order."""
    schedule.order(items, _group_of, schedule.start_order(schedule.read_slow_entries()))
