"""The CLI's task import paths and keyword arguments: one sentence naming the fix, before any data
is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import cli

TASK = """
import torch
from kiln import TrainingModule

BUILT = []


class Reg(TrainingModule):
    def __init__(self, hidden=8, depth=1):
        super().__init__()
        self.net = torch.nn.Linear(4, hidden)

    def training_step(self, batch):
        return self.net(batch["x"]).pow(2).mean()


def data(n=8):
    BUILT.append(n)
    return {"train_dataset": [{"x": torch.randn(4)} for _ in range(n)]}


def data_with_model_args():  # not counted in BUILT: a test asserts that nothing else built data
    return {"train_dataset": [{"x": torch.randn(4)} for _ in range(8)], "model_args": {"hiden": 3}}
"""


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "errtask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        f"output_dir: {tmp_path / 'out'}\ntask: {{model: 'errtask:Reg', data: 'errtask:data'}}\nmax_steps: 1\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert cli.main(["fit", "cfg.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and err.count("\n") == 1, err
    return err.removeprefix("kiln: error: ").strip()


def test_unknown_model_args_name_the_callable_and_its_parameters(task: Path, capsys: pytest.CaptureFixture) -> None:
    import errtask

    assert _error(capsys, "task.model_args.hiden=3") == (
        "task.model_args has 'hiden', which errtask:Reg does not take; "
        "its parameters are hidden, depth. Did you mean 'hidden'?"
    )
    assert errtask.BUILT == []  # refused before the data was built


def test_unknown_data_args(task: Path, capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, "task.data_args.size=3") == (
        "task.data_args has 'size', which errtask:data does not take; its parameters are n."
    )


def test_import_path_not_found_names_the_working_directory(task: Path, capsys, monkeypatch) -> None:
    elsewhere = task / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "cfg.yaml").write_text("task: {model: 'nomod.models:Reg', data: 'errtask:data'}\n")
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    assert _error(capsys) == (
        f"cannot import task.model='nomod.models:Reg': no module 'nomod' on the import path (working directory {elsewhere}, "
        "PYTHONPATH /somewhere); run kiln from the folder that holds 'nomod', or add that folder to PYTHONPATH."
    )


def test_missing_attribute_suggests_the_close_name(task: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        _error(capsys, "task.model=errtask:Regg")
        == "cannot import task.model='errtask:Regg': module 'errtask' has no 'Regg'. Did you mean 'Reg'?"
    )


@pytest.mark.parametrize("missing", ["task.model", "task.data"])
def test_a_task_missing_either_callable_is_one_sentence(task: Path, capsys: pytest.CaptureFixture, missing) -> None:
    assert _error(capsys, f"{missing}=null") == (
        "the config must name task.model and task.data ('package.module:callable')."
    )


def test_model_args_the_data_returns_are_checked_against_the_model(task: Path, capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, "task.data=errtask:data_with_model_args") == (
        "task.model_args (with the model_args errtask:data_with_model_args returned) has 'hiden', which errtask:Reg "
        "does not take; its parameters are hidden, depth. Did you mean 'hidden'?"
    )
