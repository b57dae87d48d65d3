"""The plug-in strategy of two_d.py, run for real on 2 gloo processes: it trains like one process
(`single`), and `kiln convert` turns its own checkpoint format into one model.safetensors equal to the
trained full weights. (The contract suite runs it through every scenario too: test_contract.py.)

Run as a script, this file is the worker: `torchrun --nproc_per_node=2 test_two_d.py OUT`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def _train(strategy: str, out: str, world: int) -> None:
    from safetensors.torch import save_file

    from tests.strategies.contract.scenarios import STEPS, full_weights, trainer_for

    save = {"save": {"strategy": "steps", "steps": STEPS}}
    trainer = trainer_for(strategy, out, "run", world, **save)
    trainer.fit()
    weights = full_weights(trainer)  # gathered on every rank
    if trainer.strategy.is_global_zero:
        save_file(weights, os.path.join(out, "live.safetensors"))


@pytest.mark.distributed
def test_two_processes_train_like_one_and_kiln_convert_reads_the_own_format(tmp_path):
    import torch
    from safetensors.torch import load_file

    import tests.strategies.plugins.two_d  # noqa: F401 - registers the format in this process, as a plug-in user does
    from kiln.cli import main as kiln
    from tests.world import run_world

    run_world(__file__, tmp_path / "two", timeout=600)
    _train("single", str(tmp_path / "one"), 1)
    live = load_file(str(tmp_path / "two" / "live.safetensors"))
    single = load_file(str(tmp_path / "one" / "live.safetensors"))
    assert live.keys() == single.keys()
    for name in live:
        torch.testing.assert_close(
            live[name], single[name], rtol=1e-5, atol=1e-6, msg=f"{name}: two_d differs from single"
        )

    from tests.strategies.contract.scenarios import STEPS

    checkpoint = tmp_path / "two" / "run" / f"checkpoint-{STEPS}"
    assert json.loads((checkpoint / "COMPLETE").read_text())["format"] == "two-d-shards"
    assert sorted(os.listdir(checkpoint / "two_d")) == ["optim", "rank0-of-2.safetensors", "rank1-of-2.safetensors"]
    assert kiln(["convert", str(checkpoint), str(tmp_path / "converted")]) == 0
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert converted.keys() == live.keys()
    for name in live:
        assert torch.equal(converted[name].float(), live[name]), (
            f"{name}: converted weights differ from the trained ones"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _train("two_d", sys.argv[1], int(os.environ.get("WORLD_SIZE", "1")))
