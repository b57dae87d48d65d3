"""`kiln evaluate` on a run that was interrupted (no trainer_state.json in output_dir, only checkpoints)
scores the best checkpoint the NEWEST complete checkpoint records. Each checkpoint's trainer state
records the best as of its own step, so an older one names a best that was later beaten."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln.engine.checkpoint.files import MARKER
from kiln.engine.checkpoint.weights import find_run_weights


def _checkpoint(out: Path, step: int, best: str) -> Path:
    """A complete checkpoint-<step>: weights, trainer state naming `best`, and a marker listing both."""
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w" * step)  # only its presence and size are read here
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "best_model_checkpoint": best}))
    files = {name: os.path.getsize(path / name) for name in ("model.safetensors", "trainer_state.json")}
    (path / MARKER).write_text(json.dumps({"step": step, "files": files}))
    return path


def test_the_newest_checkpoints_best_wins_over_an_older_stale_best(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 2, str(out / "checkpoint-2"))  # the best so far at step 2
    _checkpoint(out, 4, str(out / "checkpoint-4"))  # beaten at step 4
    _checkpoint(out, 6, str(out / "checkpoint-4"))  # step 6 was worse: the best is still step 4
    found = find_run_weights(str(out))
    assert found is not None
    assert (os.path.basename(found.path), found.step, found.origin) == ("checkpoint-4", 4, "best checkpoint")


def test_an_incomplete_newest_checkpoint_is_passed_over(tmp_path):
    """The run died while writing checkpoint-6: its marker is missing, so step 4's record counts."""
    out = tmp_path / "run"
    _checkpoint(out, 2, "checkpoint-2")
    _checkpoint(out, 4, "checkpoint-4")  # recorded relative: the run folder may have moved
    (_checkpoint(out, 6, "checkpoint-6") / MARKER).unlink()
    found = find_run_weights(str(out))
    assert found is not None and os.path.basename(found.path) == "checkpoint-4"
