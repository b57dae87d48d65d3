"""Who is "process zero" and who talks, on every rank of a 2-node x 2-process job (one stand-in per rank,
alone in this process: tests/topology/fake_world.py). Ranks: (global, local, node) = (0, 0, 0), (1, 1, 0),
(2, 0, 1), (3, 1, 1); global rank 2 is the one that tells a global rule from a local one."""

from __future__ import annotations

import logging
import os

import pytest

from kiln import Callback, Trainer
from kiln.engine.callbacks.loggers import LoggerCallback
from tests.helpers import TinyRegressor, regression_data
from tests.topology.fake_world import stand_in

RANKS = [0, 1, 2, 3]


def _config(out, **overrides):
    cfg = {
        "output_dir": str(out),
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "report_to": "none",
        "strategy": {"device": "cpu"},
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def _trainer(out, rank, callbacks=(), **overrides):
    return Trainer(
        TinyRegressor(),
        _config(out, **overrides),
        train_dataset=regression_data(16),
        strategy=stand_in(rank),
        callbacks=list(callbacks),
    )


class Flags(Callback):
    """The process-zero flags every event of a fit sees."""

    def __init__(self) -> None:
        self.seen: set[tuple[bool, bool]] = set()

    def _note(self, state):
        self.seen.add((state.is_world_process_zero, state.is_local_process_zero))

    def on_train_begin(self, config, state, control, **kw):
        self._note(state)

    def on_step_end(self, config, state, control, **kw):
        self._note(state)

    def on_log(self, config, state, control, **kw):
        self._note(state)


@pytest.mark.parametrize("rank", RANKS)
def test_world_zero_is_global_rank_0_and_local_zero_is_each_nodes_rank_0(tmp_path, rank):
    flags = Flags()
    trainer = _trainer(tmp_path, rank, [flags])
    expected = (rank == 0, rank % 2 == 0)
    assert (trainer.is_world_process_zero(), trainer.is_local_process_zero()) == expected
    assert (trainer.state.is_world_process_zero, trainer.state.is_local_process_zero) == expected
    trainer.fit()
    assert flags.seen == {expected}  # as the callbacks see them during training


def test_a_resumed_rank_keeps_its_own_flags_not_the_writers(tmp_path):
    """trainer_state.json holds the flags of the rank that wrote it (global rank 0: both true); node 1's
    local rank 0 resuming from it must still be local zero only."""
    _trainer(tmp_path, 0, max_steps=2, save={"strategy": "steps", "steps": 2}).fit()
    flags = Flags()
    trainer = _trainer(tmp_path, 2, [flags], max_steps=4, save={"on_each_node": True})  # reads the folder itself
    with pytest.warns(UserWarning, match="rng_state_2.pth is missing"):  # rank 0 wrote only its own
        trainer.fit(resume_from_checkpoint=True)
    assert trainer.state.global_step == 4 and flags.seen == {(False, True)}


@pytest.mark.parametrize("rank", RANKS)
def test_console_output_is_global_rank_0s(tmp_path, capsys, rank):
    """The model summary line, the progress lines (no terminal) and the printed log dicts (disable_tqdm)."""
    _trainer(tmp_path / "bar", rank, log={"disable_tqdm": False}).fit()
    bar = capsys.readouterr()
    _trainer(tmp_path / "printed", rank).fit()
    printed = capsys.readouterr()
    assert ("training 3 steps" in bar.err) == (rank == 0)
    assert ("[step 3/3" in bar.err) == (rank == 0)
    assert ("'loss':" in printed.out) == (rank == 0)
    assert ("kiln: model TinyRegressor" in printed.out) == (rank == 0)


@pytest.mark.parametrize("on_each_node", [True, False])
@pytest.mark.parametrize("rank", RANKS)
def test_the_training_summary_is_logged_by_the_main_process_of_each_node_or_of_the_job(
    tmp_path, caplog, rank, on_each_node
):
    """HF's `should_log`: each node's local rank 0 with log_on_each_node (the default), else global rank 0
    (replicas log at INFO here too, so only that rule can keep the block off them)."""
    trainer = _trainer(tmp_path, rank, log={"level": "info", "level_replica": "info", "on_each_node": on_each_node})
    with caplog.at_level(logging.INFO, logger="kiln"):
        trainer.fit()
    main = rank % 2 == 0 if on_each_node else rank == 0
    assert ("***** Running training *****" in caplog.text) == main


@pytest.mark.parametrize("rank", RANKS)
def test_only_global_rank_0_has_trackers_and_history_files(tmp_path, rank):
    trainer = _trainer(tmp_path, rank, log={"history": ["csv", "jsonl"]}, save={"on_each_node": True})
    trainer.fit()
    has_logger = any(isinstance(cb, LoggerCallback) for cb in trainer.callback_handler.callbacks)
    assert has_logger == (rank == 0)
    written = sorted(os.listdir(tmp_path / "runs")) if (tmp_path / "runs").is_dir() else []
    assert written == (["metrics.csv", "metrics.jsonl"] if rank == 0 else [])  # node 1's writer (rank 2) included
