"""The order in which `pytest -n 2 --dist loadgroup` hands test files to its two workers.

xdist gives a worker one file (one xdist group) at a time, in the order the files were collected, and by
default first re-sorts the files by their number of tests. That put the slow multi-process files, which
hold few tests each, at the end of the run: the last one started when the other worker had nothing left,
and the run waited minutes on one core. Here the slowest groups go first, longest first (the greedy
longest-processing-time rule), the rest keep pytest-randomly's shuffled order, and the XLA suite, which
runs in an environment that `.ci/run` builds beside the tests, goes last.

Two slow groups are the exception (AFTER_START): they start a couple of minutes in. `.ci/run` builds
DeepSpeed's JIT op and runs lint and mypy beside the first tests, and these two suffer most from it: the
DeepSpeed world waits for that op (237 s against 94 s idle), and Ray's cluster start-up and trials slow down
far more than the load (the Ray group 325 s against 155 s; Ray Tune's trials 185 s against 12 s). Started after
the first slow groups, they still end long before the run does.

`tests/slow_files.txt` lists the slow groups, slowest first. Regenerate it from a full run's durations:

    python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=0 > run.log
    python -m tests.schedule run.log
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
SLOW_FILES = os.path.join(HERE, "slow_files.txt")
#: groups that run after every other one
LAST = ("tests/xla/test_xla_env.py",)
#: a group under this many seconds is not worth placing: it keeps its random place
MIN_SECONDS = 15.0
#: slow groups held back until the slow groups before them sum to START_SECONDS (the module docstring says why)
AFTER_START = ("ray", "deepspeed-world")
START_SECONDS = 240.0  # about two minutes of two workers

_DURATION = re.compile(r"^\s*([0-9.]+)s\s+(?:setup|call|teardown)\s+(\S+)")


def read_slow_entries(path: str = SLOW_FILES) -> list[tuple[str, float]]:
    """The listed groups and their seconds, slowest first (a line is `group  # seconds`; blank lines and
    comment lines skipped; a line without seconds counts 0)."""
    if not os.path.exists(path):
        return []
    entries = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            name, _, seconds = line.partition("#")
            if name.strip():
                try:
                    entries.append((name.strip(), float(seconds)))
                except ValueError:
                    entries.append((name.strip(), 0.0))
    return entries


def read_slow_groups(path: str = SLOW_FILES) -> list[str]:
    """The listed groups, slowest first."""
    return [name for name, _ in read_slow_entries(path)]


def start_order(
    entries: list[tuple[str, float]], after: Iterable[str] = AFTER_START, start_seconds: float = START_SECONDS
) -> list[str]:
    """The slow groups in the order they are handed out: slowest first, except the `after` groups, which go
    right after the first other groups whose seconds reach `start_seconds` (at the end if they never do)."""
    late = set(after)
    held = [name for name, _ in entries if name in late]
    placed: list[str] = []
    total = 0.0
    for name, seconds in entries:
        if name in late:
            continue
        placed.append(name)
        total += seconds
        if held and total >= start_seconds:
            placed += held
            held = []
    return placed + held


def rank_of(slow_groups: list[str]) -> Callable[[str], int]:
    """A sort key over group names: listed groups by their place, then the rest (tied, so a stable sort
    keeps their shuffled order), then the groups in LAST."""
    place = {name: i for i, name in enumerate(slow_groups)}
    rest, last = len(slow_groups), len(slow_groups) + 1

    def rank(group: str) -> int:
        if group in LAST:
            return last
        return place.get(group, rest)

    return rank


def order(items: list, group_of: Callable[[object], str], slow_groups: list[str]) -> None:
    """Sorts `items` in place by their group's rank; stable, so each group's own order is kept."""
    rank = rank_of(slow_groups)
    items.sort(key=lambda item: rank(group_of(item)))


def group_seconds(lines: Iterable[str], group_of_path: Callable[[str], str]) -> dict[str, float]:
    """Seconds per group, summed over the set-up, call and teardown lines of a `--durations=0` report.
    Under xdist a node id ends in `@<group>`, which names the group; else the path before `::` does."""
    totals: dict[str, float] = defaultdict(float)
    for line in lines:
        match = _DURATION.match(line)
        if match:
            nodeid, _, group = match.group(2).partition("@")
            totals[group or group_of_path(nodeid.split("::", 1)[0])] += float(match.group(1))
    return dict(totals)


def render(totals: dict[str, float]) -> str:
    slow = sorted(((s, g) for g, s in totals.items() if s >= MIN_SECONDS and g not in LAST), reverse=True)
    header = "# Slowest xdist groups first (seconds: set-up, calls and teardown summed). Made by tests/schedule.py.\n"
    return header + "".join(f"{group}  # {seconds:.0f}\n" for seconds, group in slow)


def main(argv: list[str]) -> int:
    from tests.conftest import group_of_path

    if len(argv) != 1:
        print("usage: python -m tests.schedule DURATIONS_LOG", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        totals = group_seconds(f, group_of_path)
    if not totals:
        print(f"no durations in {argv[0]}: run pytest with --durations=0", file=sys.stderr)
        return 1
    with open(SLOW_FILES, "w", encoding="utf-8") as f:
        f.write(render(totals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
