"""tests/schedule.py: the order xdist hands test files to its workers (slowest first, XLA last)."""

from __future__ import annotations

from tests import schedule
from tests.conftest import group_of_path


def test_slow_groups_go_first_longest_first_and_xla_last_and_the_rest_keep_their_order():
    items = ["a.py", "xla", "b.py", "slow2.py", "c.py", "slow1.py", "slow2.py"]
    group = {"xla": "tests/xla/test_xla_env.py"}.get
    schedule.order(items, lambda item: group(item, item), ["slow1.py", "slow2.py", "absent.py"])
    assert items == ["slow1.py", "slow2.py", "slow2.py", "a.py", "b.py", "c.py", "xla"]


def test_durations_are_summed_per_group_and_the_small_ones_left_out(tmp_path):
    log = [
        "random test order: replay it with --randomly-seed=1",
        "12.50s setup    tests/a/test_x.py::test_one@tests/a/test_x.py",
        "10.00s call     tests/a/test_x.py::test_one[p-1]@tests/a/test_x.py",
        "0.50s teardown tests/a/test_x.py::test_two@tests/a/test_x.py",
        "40.00s call     tests/launch/test_ray_train.py::test_r@ray",
        "30.00s call     tests/launch/test_ray_tune.py::test_t@ray",
        "14.00s call     tests/b/test_small.py::test_s",
        "20.00s call     tests/strategies/deepspeed/test_one.py::test_d@deepspeed-world",
        "25.00s setup    tests/strategies/deepspeed/test_two.py::test_e@deepspeed-world",
        "90.00s call     tests/xla/test_xla_env.py::test_xla_suite_passes_in_the_xla_environment",
        "(12 durations < 0.005s hidden.)",
    ]
    totals = schedule.group_seconds(log, group_of_path)
    assert totals == {
        "tests/a/test_x.py": 23.0,
        "ray": 70.0,
        "tests/b/test_small.py": 14.0,
        "tests/xla/test_xla_env.py": 90.0,
        "deepspeed-world": 45.0,
    }
    path = tmp_path / "slow.txt"
    path.write_text(schedule.render(totals))
    assert schedule.read_slow_groups(str(path)) == ["ray", "deepspeed-world", "tests/a/test_x.py"]


def test_ray_and_deepspeed_start_once_the_slow_groups_before_them_reach_the_start_seconds():
    entries = [("ray", 150.0), ("a", 90.0), ("deepspeed-world", 94.0), ("b", 80.0), ("c", 75.0), ("d", 10.0)]
    assert schedule.start_order(entries, start_seconds=240.0) == ["a", "b", "c", "ray", "deepspeed-world", "d"]
    assert schedule.start_order(entries, start_seconds=90.0) == ["a", "ray", "deepspeed-world", "b", "c", "d"]
    # never reached: at the end of the slow groups, still before the unlisted ones
    assert schedule.start_order(entries, start_seconds=1e9) == ["a", "b", "c", "d", "ray", "deepspeed-world"]
    assert schedule.start_order(entries, after=()) == [name for name, _ in entries]


def test_the_shipped_list_starts_ray_and_deepspeed_after_other_slow_groups():
    order = schedule.start_order(schedule.read_slow_entries())
    first = min(order.index(name) for name in schedule.AFTER_START)
    before = dict(schedule.read_slow_entries())
    assert sum(before[name] for name in order[:first]) >= schedule.START_SECONDS
    assert set(schedule.AFTER_START) <= set(order)


def test_the_shipped_list_names_groups_that_exist():
    import os

    root = os.path.dirname(schedule.HERE)
    for group in schedule.read_slow_groups():
        assert os.path.exists(os.path.join(root, group)) or "/" not in group, group
