"""Ctrl-C under `kiln fit --nproc`: the rank that got SIGINT leaves a mark in the launcher's folder
before it unwinds, and a rank whose collective then fails on the lost peer reports the interrupt
(exit 130, one line on rank 0), not an error. The two-process run is tests/distributed/test_ctrl_c.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kiln import Callback, Trainer, cli
from kiln.launch import worker
from kiln.launch.local import REPORT_DIR
from kiln.utils.errors import TrainingInterrupted
from tests.helpers import TinyRegressor, base_config, regression_data


@pytest.fixture
def report_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "report"
    folder.mkdir()
    monkeypatch.setenv(REPORT_DIR, str(folder))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    previous = signal.getsignal(signal.SIGINT)
    yield folder
    signal.signal(signal.SIGINT, previous)


def _mark(report_dir: Path, rank: str = "1") -> None:
    os.environ["RANK"] = rank
    try:
        with pytest.raises(KeyboardInterrupt):
            worker._on_sigint(signal.SIGINT, None)
    finally:
        del os.environ["RANK"]


def test_sigint_leaves_a_mark_for_this_attempt_and_raises(report_dir: Path) -> None:
    _mark(report_dir, rank="1")
    assert sorted(os.listdir(report_dir)) == ["interrupted_2_1"]


def test_peer_interrupted_reads_only_this_attempts_marks(report_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not worker.peer_interrupted()
    (report_dir / "interrupted_1_1").touch()  # an earlier attempt's Ctrl-C, before a restart
    assert not worker.peer_interrupted()
    _mark(report_dir)
    assert worker.peer_interrupted()
    monkeypatch.delenv(REPORT_DIR)
    assert not worker.peer_interrupted()  # not a `kiln --nproc` worker


def test_after_a_peers_interrupt_this_ranks_own_late_sigint_is_quiet(report_dir: Path) -> None:
    _mark(report_dir)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert worker.peer_interrupted()
    signal.raise_signal(signal.SIGINT)  # would raise KeyboardInterrupt and cut rank 0's one line short


class _LostPeer(Callback):
    def on_step_end(self, config, state, control, **kw):
        if state.global_step == 2:
            raise RuntimeError("[gloo] Connection closed by peer")


def _fit(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, max_steps=4, per_device_train_batch_size=4)
    Trainer(TinyRegressor(), cfg, train_dataset=regression_data(32), callbacks=[_LostPeer()]).fit()


def test_fit_reports_a_lost_peer_after_its_interrupt_as_the_interrupt(tmp_path: Path, report_dir: Path) -> None:
    _mark(report_dir)
    with pytest.raises(TrainingInterrupted, match=r"^interrupted at step 2; last checkpoint: none$"):
        _fit(tmp_path)


def test_fit_reports_a_lost_peer_without_an_interrupt_as_the_error(tmp_path: Path, report_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _fit(tmp_path)


TASK = """
def data():
    raise RuntimeError("[gloo] Connection closed by peer")
"""


@pytest.mark.parametrize("interrupted", [True, False])
def test_cli_outside_fit(
    tmp_path: Path, report_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, interrupted: bool
) -> None:
    (tmp_path / "peertask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        f"output_dir: {tmp_path / 'out'}\ntask: {{model: 'tests.helpers:TinyRegressor', data: 'peertask:data'}}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    if interrupted:
        _mark(report_dir)
    code = cli.main(["fit", "cfg.yaml"])
    err = capsys.readouterr().err
    if interrupted:
        assert (code, err) == (130, "kiln: interrupted\n")
    else:
        assert code == 2 and err.startswith("kiln: error: RuntimeError: [gloo] Connection closed by peer"), err


@pytest.mark.parametrize("under_launcher", [True, False])
def test_the_worker_shim_marks_ctrl_c_only_under_kiln_launcher(tmp_path: Path, under_launcher: bool) -> None:
    import subprocess
    import sys

    script = tmp_path / "which.py"
    script.write_text("import signal\nh = signal.getsignal(signal.SIGINT)\nprint(getattr(h, '__name__', h))\n")
    env = {k: v for k, v in os.environ.items() if k not in (REPORT_DIR, "RANK")}
    if under_launcher:
        env[REPORT_DIR] = str(tmp_path)
    import signal

    out = subprocess.run(
        [sys.executable, "-m", "kiln.launch.worker", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        # as a terminal's foreground job starts (a shell's background job, e.g. `pytest &`, ignores SIGINT,
        # and Python then installs no handler of its own)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ).stdout.strip()
    assert out == ("_on_sigint" if under_launcher else "default_int_handler")
