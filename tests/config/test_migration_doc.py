"""docs/migration.md opens with an HF 5 training script whose only change is the Trainer import; it
must run as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def _doc_script() -> str:
    text = (REPO / "docs" / "migration.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_the_hf_script_in_the_migration_doc_runs_on_kiln(tmp_path):
    script = _doc_script()
    assert "from kiln import Trainer  # was: from transformers import Trainer" in script
    assert "args=args" in script and "TrainingArguments(" in script
    (tmp_path / "script.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'eval_accuracy':" in proc.stdout
    assert (tmp_path / "bert-out" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "bert-out" / "checkpoint-6" / "COMPLETE").is_file()
