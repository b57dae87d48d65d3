"""`predict` with `predict_with_generate` under FSDP on 2 processes (a tiny GPT-2 built from a config)
returns what generate() gives on the whole model in one process, although one rank's sequences stop
after one token while the other's run on (Transformers syncs generation across the ranks of an
FSDP-managed module; checked by hand: with synced_gpus=False the job fails in a collective)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed


def test_predict_with_generate_equals_one_process(shared_job):  # worker_generate.py, in conftest.shared_job
    r = json.loads((shared_job / "generate" / "result.json").read_text())
    assert r["sharded"] == "FSDPStrategy" and r["imbalance"] > 0  # the ranks really generate different lengths
    by_row = {int(key.strip("(),")): gen[0] for key, gen in r["by_hand"].items()}
    preds = r["predictions"]
    width = max(len(p) for p in preds)
    assert len(preds) == 8
    for i, pred in enumerate(preds):
        prompt_and_new = r["prompts"][i] + by_row[i]
        assert pred == prompt_and_new + [-100] * (width - len(prompt_and_new)), f"row {i}"


def test_the_users_module_called_directly_after_fit_sees_whole_weights(shared_job):  # worker_direct.py
    """A TrainingModule's embeddings and head sit in the FSDP unit of kiln's parameterless root: a call of the
    module itself (a callback's model.generate(), model(x) after fit) skipped that unit's gathering before."""
    r = json.loads((shared_job / "direct" / "result.json").read_text())
    assert r["trained"] == 2
    assert r["max_diff"] < 1e-6
    assert r["generated"] == r["expected"]
    assert r["sharded_after"]  # gathered for the call only
