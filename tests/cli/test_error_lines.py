"""Errors from the user's code that kiln calls reach the CLI as one line naming the problem (and where
in the user's code it came from), not a traceback; `--traceback` shows the full one (issue 34, item 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import cli
from kiln.cli import errors

TASK = """
import torch
from kiln import TrainingModule


class Reg(TrainingModule):
    def __init__(self, mode="ok"):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.mode = mode

    def training_step(self, batch):
        if self.mode == "none":
            return None
        if self.mode == "divide":
            return 1 / 0
        if self.mode == "library":  # raised inside the standard library, called from here
            return __import__("json").loads("not json")
        if self.mode == "interrupt":  # Ctrl-C
            raise KeyboardInterrupt
        if self.mode == "value":  # a ValueError of the user's, not kiln's own sentence
            raise ValueError("bad value")
        return self.net(batch["x"]).pow(2).mean()


def data(n=8):
    return {"train_dataset": [{"x": torch.randn(4)} for _ in range(n)]}


def not_a_model():
    return "a string"
"""


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "linetask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        f"output_dir: {tmp_path / 'out'}\ntask: {{model: 'linetask:Reg', data: 'linetask:data'}}\n"
        "max_steps: 1\nsave_strategy: 'no'\nlog: {disable_tqdm: true, history: []}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _line(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert cli.main(["fit", "cfg.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kiln: error: "), err
    return last.removeprefix("kiln: error: ")


def test_training_step_returning_none(task: Path, capsys: pytest.CaptureFixture) -> None:
    assert _line(capsys, "task.model_args.mode=none").startswith(
        "Cannot find a loss in a model output of type NoneType"
    )


def test_model_factory_of_the_wrong_type(task: Path, capsys: pytest.CaptureFixture) -> None:
    assert _line(capsys, "task.model=linetask:not_a_model") == (
        "task.model (linetask:not_a_model) returned a str, not a torch.nn.Module: return the model (a kiln "
        "TrainingModule, or a Transformers-style model that returns its loss)."
    )


def test_an_exception_in_user_code_names_where(task: Path, capsys: pytest.CaptureFixture) -> None:
    line = _line(capsys, "task.model_args.mode=divide")
    assert line.startswith("ZeroDivisionError: division by zero (in training_step, ")
    assert "linetask.py:16)" in line and line.endswith("rerun with --traceback for the full traceback.")
    # raised in a library the user's code called: the line names the user's frame, not the library's
    line = _line(capsys, "task.model_args.mode=library")
    assert line.startswith("JSONDecodeError: Expecting value: line 1 column 1 (char 0) (in training_step, ")
    assert "linetask.py:18)" in line
    line = _line(capsys, "task.model_args.mode=value")
    assert line.startswith("ValueError: bad value (in training_step, ") and "linetask.py:22)" in line


def test_traceback_flag_shows_the_traceback(task: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        cli.main(["fit", "cfg.yaml", "task.model_args.mode=divide", "--traceback"])
    with pytest.raises(TypeError, match="Cannot find a loss"):
        cli.main(["fit", "cfg.yaml", "--traceback", "task.model_args.mode=none"])


def test_help_lists_the_flag(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["fit", "--help"]) == 0
    assert "--traceback" in capsys.readouterr().out


def test_ctrl_c_is_one_line_from_rank_zero_and_exit_code_130(
    task: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["fit", "cfg.yaml", "task.model_args.mode=interrupt"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "kiln: interrupted at step 0; last checkpoint: none"
    assert errors.interrupted() == 130 and capsys.readouterr().err == "kiln: interrupted\n"  # a peer's Ctrl-C
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert errors.interrupted(KeyboardInterrupt("stop")) == 130 and capsys.readouterr().err == ""  # rank 0 says it


def test_only_a_runtime_error_gets_the_lost_peer_note(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    import torch.distributed  # noqa: F401  (the note is looked for only once torch.distributed is in use)

    from kiln.strategies import process_group
    from kiln.utils.errors import ConfigError

    monkeypatch.setattr(process_group, "lost_peer_note", lambda: "rank 1 died")
    assert errors.failed(ConfigError("bad setting")) == 2
    assert capsys.readouterr().err == "kiln: error: bad setting\n"
    assert errors.failed(RuntimeError("collective failed")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "rank 1 died"


def test_only_a_runtime_error_can_be_a_peers_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.launch import worker

    assert not errors.by_peer_interrupt(RuntimeError("collective failed"))  # no peer was interrupted
    monkeypatch.setattr(worker, "peer_interrupted", lambda: True)
    assert errors.by_peer_interrupt(RuntimeError("collective failed"))
    assert not errors.by_peer_interrupt(ValueError("bad value"))
