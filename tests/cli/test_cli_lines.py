"""What `kiln` says on its own (issue 30, item 12d): bare `kiln` is a usage error (help, exit 2), and
`kiln fit` names its output_dir, absolute, once when it starts and once when it ends, on rank 0, unless
the log level asks for quiet."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import cli

TASK = """
import torch
from kiln import TrainingModule


class Reg(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch):
        return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])


def data():
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return {"train_dataset": [{"x": row, "y": row.sum()} for row in x]}
"""


def test_bare_kiln_prints_the_help_and_fails(capsys: pytest.CaptureFixture) -> None:
    assert cli.main([]) == 2
    assert "kiln fit CONFIG.yaml" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "kiln fit CONFIG.yaml" in capsys.readouterr().out


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "outdirtask.py").write_text(TASK)
    (tmp_path / "cfg.yaml").write_text(
        "output_dir: out/run\ntask: {model: 'outdirtask:Reg', data: 'outdirtask:data'}\n"
        "max_steps: 2\nper_device_train_batch_size: 8\nlog: {disable_tqdm: true}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_fit_names_its_output_dir_at_start_and_end(task: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["fit", "cfg.yaml"]) == 0
    lines = capsys.readouterr().out.splitlines()
    where = str((task / "out" / "run").resolve())
    named = [line for line in lines if where in line]
    assert named == [f"kiln: output_dir {where}", f"kiln: done; the run's files are in {where}"]
    assert lines.index(named[0]) < min(i for i, line in enumerate(lines) if line.startswith("kiln: model "))


def test_quiet_fit_does_not(task: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["fit", "cfg.yaml", "log.level=error"]) == 0
    assert "output_dir" not in capsys.readouterr().out


def test_config_docs_prints_the_config_reference(capsys: pytest.CaptureFixture) -> None:
    from kiln.config.docs import config_markdown

    assert cli.main(["config-docs"]) == 0
    out = capsys.readouterr().out
    assert out == config_markdown() and "per_device_train_batch_size" in out
