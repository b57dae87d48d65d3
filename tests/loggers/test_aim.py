"""Aim: the repository output_dir/.aim, read back with Aim's own Repo and Run (after Aim's indexer
has indexed the run, as `aim up` does)."""

from __future__ import annotations

import pytest

pytest.importorskip("aim", reason="pip install kiln[aim]")

from kiln.engine.callbacks.loggers import LoggerCallback  # noqa: E402
from kiln.loggers.aim import AimLogger  # noqa: E402
from kiln.loggers.build import build_loggers  # noqa: E402
from tests.loggers.conftest import make_config  # noqa: E402
from tests.loggers.tracker_parity import Read, assert_same, no_network, train, trials  # noqa: E402,F401


def runs(repo_dir: str) -> list[Read]:
    from aim import Repo, Run
    from aim.sdk.index_manager import RepoIndexManager

    repo = Repo.from_path(repo_dir)
    hashes = repo.list_all_runs()
    for run_hash in hashes:  # all before reading any: a read caches the index as it is
        RepoIndexManager.get_index_manager(repo).index(run_hash)
    found = []
    for run_hash in hashes:
        run = Run(run_hash, repo=repo, read_only=True)
        metrics = {}
        for metric in run.metrics():
            frame = metric.dataframe()
            metrics[f"{metric.context['subset']}/{metric.name}"] = list(
                zip(frame["step"].tolist(), frame["value"].tolist())
            )
        found.append(Read(run.name, metrics, run.get("hparams", {})))
        found[-1].experiment = run.experiment  # type: ignore[attr-defined]
    return found


def test_a_run_holds_what_tensorboard_holds(tmp_path, monkeypatch, no_network):
    out = train(tmp_path, monkeypatch, "aim")
    [run] = runs(out)
    assert_same(run, out, one_per_step=True)  # Aim keys a sequence by step
    assert run.experiment == "kiln"


def test_evaluate_after_fit_continues_the_run(tmp_path):
    cfg = make_config(tmp_path)
    logger = AimLogger(cfg)
    logger.log_metrics({"loss": 0.5}, 7)
    logger.finalize("success")
    logger.log_metrics({"eval_loss": 0.25}, 8)
    logger.finalize("success")
    [run] = runs(cfg.output_dir)
    assert run.metrics == {"train/loss": [(7, 0.5)], "eval/loss": [(8, 0.25)]} and run.name == "unit-run"


def test_trials_are_runs_tagged_with_the_search(tmp_path):
    cfg = make_config(tmp_path, report_to=["aim"])
    trials(LoggerCallback(cfg, build_loggers(cfg)), cfg)
    found = sorted(runs(cfg.output_dir), key=lambda r: r.name)
    assert [(r.name, r.params["lr"], r.metrics) for r in found] == [
        (f"trial-{i}", i, {"train/loss": [(1, float(i))]}) for i in range(2)
    ]
