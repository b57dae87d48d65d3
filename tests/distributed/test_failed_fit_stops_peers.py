"""When `fit()` raises on one rank and the script catches it and keeps its process alive, the other ranks
do not wait out the collective timeout (30 minutes by default): the failing rank aborts the process group
(kiln/engine/loop/fit_errors.py), so a peer's next or pending collective fails at once, with an error that
names the failing rank and its error, while the failing rank's script sees its own exception unchanged (and a
second fit() in its process says that the group is gone).

Two processes, gloo: DDP (the peer waits in the gradient all-reduce), a pipeline of two stages (the peer,
stage 1, waits for stage 0's activations) and DeepSpeed ZeRO-3 (its engine, optimizer, zero.Init object and
parameters hold the group, which the strategy releases: kiln/strategies/deepspeed/runtime.py). Rank 0 raises
at the end of step 3, catches the error and stays alive for up to 120 s, until rank 1 has written its
outcome: without the abort (or with the group still held), rank 1 would hang and the world would run past
its 60 s timeout (TimeoutExpired fails the test).

Run by `run_world`, this file is the worker (`python THIS OUT STRATEGY`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

if __name__ == "__main__":  # the world's worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.installed import requires  # noqa: E402
from tests.world import run_world  # noqa: E402

pytestmark = pytest.mark.distributed
FAILURE = "injected failure on rank 0 at step 3"
WORLD_TIMEOUT = 60  # seconds; the peer's collective timeout is kiln's default, 1800 s


def _outcome(out: str, rank: int) -> str:
    return os.path.join(out, f"rank{rank}.json")


def worker(out: str, strategy: str) -> None:
    import torch

    from kiln import Callback, Trainer

    rank = int(os.environ["RANK"])

    class Fail(Callback):
        def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 3 and rank == 0:
                raise ValueError(FAILURE)

    if strategy == "pp":
        from tests.strategies.pipeline.cases import config, data, llama

        pp = {"name": "model_parallel", "device": "cpu", "mesh": {"pp": 2}}
        cfg = config(os.path.join(out, "run"), pp, max_steps=1000, num_train_epochs=100)
        trainer = Trainer(llama(), cfg, train_dataset=data(), callbacks=[Fail()])
    else:
        from tests.distributed import toy

        torch.manual_seed(0)
        cfg = toy.scenario_config("plain", os.path.join(out, "run"), world=2, max_steps=1000)
        if strategy == "deepspeed":  # ZeRO-3: the engine, its optimizer and every parameter hold the group
            cfg["strategy"] = {"name": "deepspeed", "device": "cpu"}
            cfg["deepspeed"] = {"zero_optimization": {"stage": 3}}
        trainer = Trainer(toy.Regressor(), cfg, train_dataset=toy.regression_data(64), callbacks=[Fail()])
    try:
        trainer.fit()
        outcome = ["finished", "", 0.0]
    except Exception as err:  # noqa: BLE001 - what a user's script that catches the failure does
        outcome = [type(err).__name__, str(err), time.time()]
    if rank == 0:  # a second fit in the process whose group was aborted
        try:
            trainer.fit()
        except Exception as err:  # noqa: BLE001
            outcome.append(f"{type(err).__name__}: {err}")
    with open(_outcome(out, rank) + ".tmp", "w") as fh:
        json.dump(outcome, fh)
    os.replace(_outcome(out, rank) + ".tmp", _outcome(out, rank))
    if rank == 0:  # alive (and holding its objects) until the peer has failed, or for 120 s
        deadline = time.time() + 120
        while not os.path.exists(_outcome(out, 1)) and time.time() < deadline:
            time.sleep(0.1)
    elif outcome[0] != "finished":
        sys.exit(1)


@pytest.mark.parametrize("strategy", ["ddp", "pp", pytest.param("deepspeed", marks=requires("deepspeed"))])
def test_a_rank_whose_fit_raises_stops_its_peers_while_it_lives_on(tmp_path, strategy):
    env = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed on CPU (the other strategies ignore it)
    proc = run_world(__file__, tmp_path, strategy, env=env, timeout=WORLD_TIMEOUT, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    (kind0, message0, failed_at, again), (kind1, message1, stopped_at) = (
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    )
    assert (kind0, message0) == ("ValueError", FAILURE)  # the user's own exception, unchanged
    assert kind1 == "RankFailed", (kind1, message1)
    assert message1.startswith(f"rank 0 failed with ValueError: {FAILURE}"), message1
    assert stopped_at - failed_at < WORLD_TIMEOUT
    assert again.startswith("KilnError: fit() cannot run again in this process"), again
    assert "still holds it" not in proc.stderr  # rank 0 freed every group: its strategy let go of them first


if __name__ == "__main__":
    worker(*sys.argv[1:])
