"""Console output: a bar in a terminal, plain lines in a log file, dicts with disable_tqdm."""

from __future__ import annotations

import io
import time
from datetime import timedelta

from kiln.engine.callbacks.progress import PrinterCallback, ProgressCallback, clock, console_callbacks, is_interactive
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from tests.loggers.conftest import make_config


def run_loop(callback, steps=200, log_every=50, eval_batches=0):
    state, control, cfg = TrainerState(max_steps=steps), TrainerControl(), None
    callback.on_train_begin(cfg, state, control)
    for step in range(1, steps + 1):
        state.global_step = step
        callback.on_step_end(cfg, state, control)
        if step % log_every == 0:
            callback.on_log(
                cfg, state, control, logs={"loss": 1.0 / step, "learning_rate": 1e-3, "epoch": step / steps}
            )
            for _ in range(eval_batches):
                callback.on_prediction_step(cfg, state, control, eval_dataloader=[0] * eval_batches)
            if eval_batches:
                callback.on_evaluate(cfg, state, control, metrics={})
    callback.on_log(cfg, state, control, logs={"train_runtime": 1.0, "total_flos": 5.0})
    callback.on_train_end(cfg, state, control)
    return state


def test_a_log_file_gets_one_plain_line_per_log_and_no_carriage_returns():
    stream = io.StringIO()  # not a TTY, like a job's log file
    assert not is_interactive(stream)
    run_loop(ProgressCallback(file=stream), steps=2000, log_every=500, eval_batches=3)
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 1 + 4 + 1  # header, one per log, the final summary
    assert lines[0] == "training 2000 steps"
    assert lines[2].startswith("[step 1000/2000  50% ") and "loss=0.001 learning_rate=0.001 epoch=0.5" in lines[2]
    assert "total_flos" not in lines[-1] and "train_runtime=1" in lines[-1]


def test_a_terminal_gets_a_bar_with_loss_and_lr():
    stream = io.StringIO()
    callback = ProgressCallback(file=stream, interactive=True)
    run_loop(callback, steps=100, log_every=50, eval_batches=2)
    text = stream.getvalue()
    assert "train" in text and "100/100" in text and "loss=0.02" in text and "learning_rate=0.001" in text
    assert "eval" in text  # the evaluation bar


def test_the_bar_shows_loss_lr_throughput_and_mfu_after_its_counter():
    stream = io.StringIO()
    callback = ProgressCallback(file=stream, interactive=True)
    state, control = TrainerState(max_steps=10), TrainerControl()
    callback.on_train_begin(None, state, control)
    state.global_step = 5
    logs = {"loss": 0.25, "learning_rate": 1e-3, "train_tokens_per_second": 1234.5, "mfu": 0.4125, "epoch": 0.5}
    callback.on_log(None, state, control, logs=logs)
    assert callback.bar.postfix == "loss=0.25, lr=0.001, tok/s=1234, mfu=0.4125"
    callback.on_log(None, state, control, logs={"loss": 0.5, "learning_rate": 1e-3})  # no model FLOPs known
    assert callback.bar.postfix == "loss=0.5, lr=0.001"
    callback.on_train_end(None, state, control)


def test_the_bar_redraws_at_most_every_refresh_interval_not_every_step():
    stream = io.StringIO()
    callback = ProgressCallback(file=stream, interactive=True)
    state, control = TrainerState(max_steps=10_000), TrainerControl()
    callback.on_train_begin(None, state, control)
    now = [time.time()]
    callback.bar._time = lambda: now[0]  # tqdm's clock, frozen: what a burst of fast steps sees
    callback.bar.last_print_t = now[0]
    drawn = len(stream.getvalue())
    for step in range(1, 1001):
        state.global_step = step
        callback.on_step_end(None, state, control)
    assert len(stream.getvalue()) == drawn and callback.bar.n == 1000  # counted, never drawn
    now[0] += 0.11
    state.global_step += 1
    callback.on_step_end(None, state, control)
    assert "1001/10000" in stream.getvalue()[drawn:]  # drawn once the interval has passed


def test_only_the_main_process_prints():
    stream = io.StringIO()
    callback = ProgressCallback(file=stream)
    state, control = TrainerState(max_steps=10, is_world_process_zero=False), TrainerControl()
    callback.on_train_begin(None, state, control)
    callback.on_log(None, state, control, logs={"loss": 1.0})
    callback.on_train_end(None, state, control)
    printer_out = io.StringIO()
    PrinterCallback(file=printer_out).on_log(None, state, control, logs={"loss": 1.0})
    assert stream.getvalue() == printer_out.getvalue() == ""


def test_printer_prints_the_log_dict():
    out = io.StringIO()
    PrinterCallback(file=out).on_log(None, TrainerState(), TrainerControl(), logs={"loss": 0.5, "total_flos": 1.0})
    assert out.getvalue() == "{'loss': 0.5}\n"


def test_console_callbacks_follow_disable_tqdm_and_the_log_level(tmp_path):
    def kinds(**log):
        return [type(cb).__name__ for cb in console_callbacks(make_config(tmp_path, log=log))]

    assert kinds() == ["ProgressCallback"]
    assert kinds(disable_tqdm=True) == ["PrinterCallback"]
    assert kinds(level="error") == ["PrinterCallback"]
    assert kinds(level="error", disable_tqdm=False) == ["ProgressCallback"]


def test_eta_clock_reads_like_timedelta():
    for seconds in (0, 0.9, 5, 59, 60, 65, 3599, 3600, 3661.7, 86399, 86400, 90061, 2 * 86400 + 5, 400 * 86400 + 3723):
        assert clock(seconds) == str(timedelta(seconds=int(seconds))), seconds


def test_plain_lines_are_written_off_the_training_thread_in_order_and_outside_fit_at_once():
    from kiln.loggers.writer import flush_writes

    stream = io.StringIO()
    callback = ProgressCallback(file=stream)
    state, control = TrainerState(max_steps=100), TrainerControl()
    callback.on_train_begin(None, state, control)
    for step in range(1, 41):
        state.global_step = step
        callback.on_log(None, state, control, logs={"loss": float(step)})
        if step % 7 == 0:
            flush_writes()  # what a save or the end of fit does: everything queued is on the stream
            assert stream.getvalue().splitlines()[-1].endswith(f"loss={step}")
    callback.on_train_end(None, state, control)
    lines = stream.getvalue().splitlines()
    assert [line.rsplit("loss=", 1)[1] for line in lines[1:]] == [str(s) for s in range(1, 41)]
    callback.on_log(None, state, control, logs={"eval_loss": 0.5})  # evaluate() after fit: written at once
    assert stream.getvalue().splitlines()[-1].endswith("eval_loss=0.5")


def test_lines_logged_before_a_failure_reach_the_stream(tmp_path):
    import pytest
    import torch

    from kiln import Callback, Trainer

    class Boom(Callback):
        def on_step_end(self, config, state, control, **kw):
            if state.global_step == 5:
                raise RuntimeError("boom")

    stream = io.StringIO()
    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": torch.tensor(0)} for _ in range(32)]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.lin(x), labels)}

    cfg = {
        "output_dir": str(tmp_path),
        "max_steps": 10,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": False,
        "log": {"history": []},
    }
    trainer = Trainer(Net(), cfg, train_dataset=data, callbacks=[Boom()])
    trainer.callback_handler.callbacks = [
        ProgressCallback(file=stream) if isinstance(cb, ProgressCallback) else cb
        for cb in trainer.callback_handler.callbacks
    ]
    trainer.callback_handler._index()
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert [line.split()[1] for line in stream.getvalue().splitlines()[1:]] == [f"{s}/10" for s in range(1, 5)]


def test_a_queued_line_shows_the_figures_and_the_time_of_its_log_event(monkeypatch):
    """The writer thread formats the line later: what it shows must be what was true when it was logged."""
    import types

    import kiln.engine.callbacks.progress as progress

    now = [100.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    stream = io.StringIO()
    callback = ProgressCallback(file=stream)
    state, control = TrainerState(max_steps=100), TrainerControl()
    callback.on_train_begin(None, state, control)
    now[0] += 65
    state.global_step = 50
    logs = {"loss": 0.5}
    callback.on_log(None, state, control, logs=logs)
    logs["loss"], state.global_step = 9.0, 60  # after the event, before the writer's tick
    now[0] += 3600
    callback.on_train_end(None, state, control)
    assert stream.getvalue().splitlines()[1] == "[step 50/100  50% 0:01:05<0:01:05] loss=0.5"
