"""Per-rank log levels (HF's log_level / log_level_replica / log_on_each_node) and
main_process_first on one process."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kiln.config import load_config
from kiln.engine.distributed import configure_logging, main_process_first, process_log_level


def fake(rank, local_rank, world=4):
    return SimpleNamespace(
        global_rank=rank,
        local_rank=local_rank,
        world_size=world,
        is_global_zero=rank == 0,
        is_local_zero=local_rank == 0,
        barrier=lambda name=None: None,
    )


@pytest.mark.parametrize(
    "on_each_node, rank, local, expected",
    [
        (True, 0, 0, logging.INFO),
        (True, 2, 0, logging.INFO),
        (True, 3, 1, logging.ERROR),
        (False, 0, 0, logging.INFO),
        (False, 2, 0, logging.ERROR),
        (False, 3, 1, logging.ERROR),
    ],
)
def test_levels_by_rank(on_each_node, rank, local, expected):
    cfg = load_config({"log_level": "info", "log_level_replica": "error", "log_on_each_node": on_each_node})
    assert process_log_level(cfg, fake(rank, local)) == expected


def test_passive_leaves_the_level_alone_and_replicas_default_to_warning():
    cfg = load_config({})
    assert process_log_level(cfg, fake(0, 0)) is None
    assert process_log_level(cfg, fake(1, 1)) == logging.WARNING


def test_configure_logging_sets_kiln_logger():
    logger = logging.getLogger("kiln")
    before = logger.level
    try:
        assert configure_logging(load_config({"log_level": "debug"}), fake(0, 0)) == logging.DEBUG
        assert logger.level == logging.DEBUG
        assert configure_logging(load_config({}), fake(0, 0)) is None and logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


def test_main_process_first_orders_the_block():
    calls = []

    def strategy(rank, local):
        s = fake(rank, local, world=2)
        s.barrier = lambda name=None: calls.append((rank, "barrier"))
        return s

    with main_process_first(strategy=strategy(0, 0)):
        calls.append((0, "work"))
    with main_process_first(strategy=strategy(1, 1)):
        calls.append((1, "work"))
    assert calls == [(0, "work"), (0, "barrier"), (1, "barrier"), (1, "work")]


def test_main_process_first_on_one_process_needs_nothing(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    with main_process_first(local=False, desc="tokenize"):
        pass
