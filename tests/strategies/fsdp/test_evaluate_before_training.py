"""With `shard_grad_op` FSDP2 does not reshard after a forward, and a forward without a backward (an
evaluation) left every unit's parameters gathered: the optimizer then updated the shards while later
forwards kept reading the stale gathered copies, so an evaluation after training reported the untrained
loss. The strategy reshards when an evaluation ends (FSDPStrategy.eval_cast_context)."""

from __future__ import annotations

import json

import pytest

from tests.strategies.fsdp.conftest import torchrun


@pytest.mark.distributed
def test_an_evaluation_before_training_does_not_freeze_the_weights_under_shard_grad_op(tmp_path):
    torchrun(2, "worker_eval_first.py", tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    first, plain = losses["eval_first"], losses["plain"]
    assert first["after"] != first["before"]  # training changed what evaluation sees
    assert first["after"] == plain["after"]  # exactly as without the first evaluation
