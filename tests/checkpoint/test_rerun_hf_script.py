"""An HF training script, run twice (issue 52 item 16). The second run is refused because output_dir holds the
first run's checkpoints (a deliberate rule), and transformers 5's TrainingArguments no longer take
`overwrite_output_dir`: the refusal must name a way that works from such a script, and that way must work."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from kiln.utils.errors import KilnError

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch
from transformers import TrainingArguments

from kiln import Trainer


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}


torch.manual_seed(0)
data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(8)]
args = TrainingArguments(output_dir="out", max_steps=2, save_steps=2, per_device_train_batch_size=4, report_to="none",
                         use_cpu=True, disable_tqdm=True)
trainer = Trainer(model=Regressor(), args=args, train_dataset=data)
result = trainer.train()
"""


def _run(folder: Path, script: str) -> dict:
    path = folder / "script.py"
    path.write_text(script)
    return runpy.run_path(str(path), run_name="__main__")


def test_the_refusal_names_a_way_that_works_from_a_training_arguments_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = _run(tmp_path, SCRIPT)
    assert first["result"].global_step == 2 and (tmp_path / "out" / "checkpoint-2" / "COMPLETE").is_file()
    saved = (tmp_path / "out" / "checkpoint-2" / "COMPLETE").stat().st_mtime_ns

    with pytest.raises(KilnError, match="already holds checkpoints") as refused:
        _run(tmp_path, SCRIPT)
    assert (tmp_path / "out" / "checkpoint-2" / "COMPLETE").stat().st_mtime_ns == saved  # nothing written over

    with pytest.raises(TypeError, match="overwrite_output_dir"):  # why the key alone cannot be the answer
        transformers.TrainingArguments(output_dir="out", overwrite_output_dir=True)
    way = re.search(r"Trainer\(\.\.\., (overrides=\[[^\]]*\])\)", str(refused.value))
    assert way, f"the refusal names no script-side way: {refused.value}"
    again = _run(tmp_path, SCRIPT.replace("train_dataset=data)", f"train_dataset=data, {way.group(1)})"))
    assert again["result"].global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "COMPLETE").stat().st_mtime_ns != saved  # trained and saved again

    doc = (REPO / "docs" / "migration.md").read_text()
    assert f"Trainer(..., {way.group(1)})" in doc, "docs/migration.md must name the same way"
