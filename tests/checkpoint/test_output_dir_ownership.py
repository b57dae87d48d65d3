"""A run never writes over another run's work: a finished run's checkpoints or exported model are not
replaced by a new run whatever its save settings, and two live runs never share one output_dir (the
second is refused naming the first; a lock left by a killed run is taken over)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from kiln.engine.checkpoint.output_dir import LOCK, OutputDirInUse, acquire, release
from kiln.utils.errors import KilnError
from tests.checkpoint.checkpoint_helpers import train

CFG = {"max_steps": 4, "save_steps": 2}


def snapshot(out: str) -> dict[str, tuple[int, float]]:
    found = {}
    for root, _, files in os.walk(out):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, out)] = (os.path.getsize(path), os.path.getmtime(path))
    return found


@pytest.fixture
def finished(tmp_path):
    """A finished run: checkpoints plus an exported model (what `kiln fit` leaves)."""
    out = str(tmp_path / "run")
    trainer = train(out, CFG)
    trainer.save_model()
    trainer.save_state()
    return out


@pytest.mark.parametrize("save", ["no", "steps", "epoch"])
def test_a_new_run_never_replaces_a_finished_one_whatever_it_saves(finished, save):
    before = snapshot(finished)
    with pytest.raises(
        KilnError,
        match=r"already holds checkpoints or an exported model \(checkpoint-4, \.\.\.\).*"
        r"resume_from_checkpoint=true.*overwrite_output_dir=true",
    ):
        train(finished, {"max_steps": 3, "save_strategy": save})
    assert snapshot(finished) == before


def test_an_exported_model_alone_is_protected_too(tmp_path):
    out = str(tmp_path / "run")
    trainer = train(out, {"max_steps": 2, "save_strategy": "no"})
    trainer.save_model()
    before = snapshot(out)
    assert "model.safetensors" in before
    with pytest.raises(KilnError, match=r"already holds checkpoints or an exported model \(model.safetensors"):
        train(out, {"max_steps": 3, "save_strategy": "no"})
    assert snapshot(out) == before
    assert train(out, {"max_steps": 3, "save_strategy": "no", "overwrite_output_dir": True}).state.global_step == 3


def test_a_second_train_of_one_trainer_continues_its_own_files(tmp_path):
    out = str(tmp_path / "run")
    trainer = train(out, CFG)
    trainer.fit()  # HF: a new run of the same Trainer; its own checkpoints are not someone else's work
    assert trainer.state.global_step == 4


def test_the_lock_is_held_during_fit_and_gone_after(tmp_path):
    from kiln.engine.callbacks.base import Callback

    out = str(tmp_path / "run")
    seen = []

    class Look(Callback):
        def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            seen.append(os.path.exists(os.path.join(out, LOCK)))

    train(out, {"max_steps": 2}, callbacks=[Look()])
    assert seen == [True, True]
    assert not os.path.exists(os.path.join(out, LOCK))


HOLDER = textwrap.dedent("""
    import sys
    from kiln.engine.checkpoint.output_dir import acquire
    acquire(sys.argv[1])
    print("locked", flush=True)
    sys.stdin.read()
""")


def hold_lock(out: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, out], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_live_run_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken_over(tmp_path, caplog):
    out = str(tmp_path / "run")
    holder = hold_lock(out)
    try:
        with pytest.raises(
            OutputDirInUse,
            match=rf"output_dir .* is in use by another kiln run \(pid {holder.pid} on .*, "
            r"started .*\); wait for it to finish, or pick another output_dir",
        ):
            train(out, CFG)
        assert not any("checkpoint" in name for name in os.listdir(out))  # nothing written beside the live run
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="kiln.engine.checkpoint.output_dir"):
        trainer = train(out, CFG)
    assert trainer.state.global_step == 4
    assert any(
        f"left by pid {holder.pid}" in r.getMessage() and "no longer running" in r.getMessage() for r in caplog.records
    )


def read_until(stream, word: str) -> None:
    for line in stream:
        if line.strip() == word:
            return
    raise AssertionError(f"the process ended before printing {word!r}")


def test_two_real_runs_on_one_output_dir(tmp_path):
    """Run A trains in another process; run B, started meanwhile, is refused and A finishes intact."""
    out = str(tmp_path / "run")
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from kiln.engine.callbacks.base import Callback
        from tests.checkpoint.checkpoint_helpers import train
        class Slow(Callback):
            def on_step_end(self, config, state, control, **kw):
                if state.global_step == 1:
                    print("training", flush=True)
                    sys.stdin.readline()  # hold here until the test has tried its run
        train({out!r}, {{"max_steps": 4, "save_steps": 2}}, callbacks=[Slow()])
        print("done", flush=True)
    """)
    run_a = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        read_until(run_a.stdout, "training")
        with pytest.raises(OutputDirInUse, match=f"pid {run_a.pid}"):
            train(out, {"max_steps": 4, "save_steps": 1})
        assert run_a.stdin is not None
        run_a.stdin.write("\n")
        run_a.stdin.flush()
        read_until(run_a.stdout, "done")
        assert run_a.wait(timeout=120) == 0
    finally:
        run_a.kill()
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]


def test_the_lock_is_reentrant_within_a_process_and_released_by_the_last_holder(tmp_path):
    out = str(tmp_path / "d")
    acquire(out)
    acquire(out)
    release(out)
    assert os.path.exists(os.path.join(out, LOCK))
    proc = subprocess.run([sys.executable, "-c", HOLDER, out], input="", capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "is in use by another kiln run" in proc.stderr
    from kiln.engine.checkpoint.output_dir import _held

    fd = _held[os.path.realpath(out)][0]
    release(out)
    assert not os.path.exists(os.path.join(out, LOCK))
    with pytest.raises(OSError):  # the descriptor (and with it the flock) is gone, not just the file
        os.fstat(fd)
    holder = hold_lock(out)  # free again for anyone
    holder.kill()
    holder.wait()


def test_the_cli_holds_the_lock_until_the_export_is_written(tmp_path):
    """Between `fit()` and `save_model()` another run must not slip in and have its files overwritten."""
    from kiln.cli import _fit
    from kiln.engine.trainer import Trainer
    from tests.checkpoint.checkpoint_helpers import config, make_model, regression_data

    out = str(tmp_path / "run")
    seen = []

    class Recording(Trainer):
        def save_model(self, output_dir=None, max_shard_size=None):  # type: ignore[no-untyped-def]
            probe = subprocess.run(
                [sys.executable, "-c", HOLDER, out], input="", capture_output=True, text=True, timeout=60
            )
            seen.append("is in use by another kiln run" in probe.stderr)
            return super().save_model(output_dir, max_shard_size)

    _fit(Recording(make_model(), config(out, max_steps=2), train_dataset=regression_data()), {})
    assert seen == [True]
    assert os.path.exists(os.path.join(out, "model.safetensors")) and not os.path.exists(os.path.join(out, LOCK))
