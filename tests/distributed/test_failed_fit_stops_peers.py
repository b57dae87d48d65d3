"""When `fit()` raises on one rank and the script catches it and keeps its process alive, the other ranks
do not wait out the collective timeout (30 minutes by default): the failing rank waits the grace period
(`kiln.strategies.abort.GRACE_S`, here shortened to 2 s) for the others to fail too, then aborts the process
group (kiln/strategies/abort.py), so a peer's pending collective fails, with an error that names the
failing rank and its error, while the failing rank's script sees its own exception unchanged (and a second
fit() in its process says that the group is gone). When every rank's fit raises (alike or not), nothing is
aborted: a later fit() in the same processes trains, and ends where a fresh run ends.

Two processes, gloo: DDP (the peer waits in the gradient all-reduce), a pipeline of two stages (the peer,
stage 1, waits for stage 0's activations) and DeepSpeed ZeRO-3 (its engine, optimizer, zero.Init object and
parameters hold the group, which the strategy releases: kiln/strategies/deepspeed/runtime.py). Rank 0 raises
at the end of step 3, catches the error and stays alive for up to 120 s, until rank 1 has written its
outcome: without the abort (or with the group still held), rank 1 would hang and the world would run past
its 60 s timeout (TimeoutExpired fails the test).

Run by `run_world`, this file is the worker (`python THIS OUT STRATEGY MODE`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # the world's worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed import toy  # noqa: E402
from tests.installed import requires  # noqa: E402
from tests.world import run_world  # noqa: E402

pytestmark = pytest.mark.distributed
FAILURE = "injected failure on rank 0 at step 3"
WORLD_TIMEOUT = 60  # seconds; the peer's collective timeout is kiln's default, 1800 s
GRACE = 2.0  # seconds, the worker's kiln.strategies.abort.GRACE_S (10 s by default)
EVERY_GRACE = 20.0  # seconds, when every rank fails: the ranks agree long before


def _outcome(out: str, rank: int) -> str:
    return os.path.join(out, f"rank{rank}.json")


def _write(out: str, rank: int, outcome: object) -> None:
    with open(_outcome(out, rank) + ".tmp", "w") as fh:
        json.dump(outcome, fh)
    os.replace(_outcome(out, rank) + ".tmp", _outcome(out, rank))


def _failing(fail_ranks: tuple[int, ...], message: str):  # type: ignore[no-untyped-def]
    """A callback raising ValueError(message, with {rank} filled in) at the end of step 3 on `fail_ranks`,
    noting when it raised."""
    from kiln import Callback

    rank = int(os.environ["RANK"])

    class Fail(Callback):
        raised_at = 0.0

        def on_step_end(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 3 and rank in fail_ranks:
                Fail.raised_at = time.time()
                raise ValueError(message.format(rank=rank))

    return Fail()


def worker(out: str, strategy: str, mode: str) -> None:
    from kiln import Trainer
    from kiln.strategies import abort

    abort.GRACE_S = GRACE
    rank = int(os.environ["RANK"])
    if mode == "every":  # every rank fails, alike then not: nothing aborted, the next fit trains
        _every_rank_fails(out, rank)
        return
    fail = _failing((0,), FAILURE)
    if strategy == "pp":
        from tests.strategies.pipeline.cases import config, data, llama

        pp = {"name": "model_parallel", "device": "cpu", "mesh": {"pp": 2}}
        cfg = config(os.path.join(out, "run"), pp, max_steps=1000, num_train_epochs=100)
        trainer = Trainer(llama(), cfg, train_dataset=data(), callbacks=[fail])
    else:
        torch.manual_seed(0)
        cfg = toy.scenario_config("plain", os.path.join(out, "run"), world=2, max_steps=1000)
        if strategy == "deepspeed":  # ZeRO-3: the engine, its optimizer and every parameter hold the group
            cfg["strategy"] = {"name": "deepspeed", "device": "cpu"}
            cfg["deepspeed"] = {"zero_optimization": {"stage": 3}}
        trainer = Trainer(toy.Regressor(), cfg, train_dataset=toy.regression_data(64), callbacks=[fail])
    try:
        trainer.fit()
        outcome = ["finished", "", 0.0]
    except Exception as err:  # noqa: BLE001 - what a user's script that catches the failure does
        outcome = [type(err).__name__, str(err), time.time()]
    if rank == 0:  # a second fit in the process whose group was aborted
        outcome.append(fail.raised_at)
        try:
            trainer.fit()
        except Exception as err:  # noqa: BLE001
            outcome.append(f"{type(err).__name__}: {err}")
    _write(out, rank, outcome)
    if rank == 0:  # alive (and holding its objects) until the peer has failed, or for 120 s
        deadline = time.time() + 120
        while not os.path.exists(_outcome(out, 1)) and time.time() < deadline:
            time.sleep(0.1)
    elif outcome[0] != "finished":
        sys.exit(1)


def _every_rank_fails(out: str, rank: int) -> None:
    """Two fits of one Trainer fail at step 3 on every rank (the same message, then one per rank), caught;
    then a fresh Trainer trains the 'plain' scenario in the same processes and group. The grace is long
    (EVERY_GRACE): a rank that waited it out would show."""
    import torch.distributed as dist

    from kiln import Trainer
    from kiln.strategies import abort, process_group

    abort.GRACE_S = EVERY_GRACE
    outcome = []
    torch.manual_seed(0)
    cfg = toy.scenario_config("plain", os.path.join(out, "failing"), world=2, max_steps=1000)
    trainer = Trainer(toy.Regressor(), cfg, train_dataset=toy.regression_data(64))
    made = process_group.group_incarnation()
    for message in (FAILURE, "rank {rank} failed its own way at step 3"):
        fail = _failing((0, 1), message)
        trainer.add_callback(fail)
        try:
            trainer.fit()
            outcome.append(["finished", "", 0.0])
        except Exception as err:  # noqa: BLE001 - what a user's script that catches the failure does
            outcome.append([type(err).__name__, str(err), time.time() - fail.raised_at])
        trainer.remove_callback(fail)
    kept = dist.is_initialized() and process_group.group_incarnation() == made and not trainer.strategy.aborted
    _, model = toy.train_scenario("plain", os.path.join(out, "fresh"), world=2)
    torch.save(toy.flat_params(model), os.path.join(out, f"weights{rank}.pt"))
    _write(out, rank, [*outcome, kept])


@pytest.mark.parametrize("strategy", ["ddp", "pp", pytest.param("deepspeed", marks=requires("deepspeed"))])
def test_a_rank_whose_fit_raises_stops_its_peers_while_it_lives_on(tmp_path, strategy):
    env = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed on CPU (the other strategies ignore it)
    proc = run_world(__file__, tmp_path, strategy, "alone", env=env, timeout=WORLD_TIMEOUT, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    (kind0, message0, failed_at, raised_at, again), (kind1, message1, stopped_at) = (
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    )
    assert (kind0, message0) == ("ValueError", FAILURE)  # the user's own exception, unchanged
    assert kind1 == "RankFailed", (kind1, message1)
    assert message1.startswith(f"rank 0 failed with ValueError: {FAILURE}"), message1
    # rank 0 waited the grace for rank 1 to fail too, then aborted: rank 1 stopped a few seconds later at most
    assert GRACE <= failed_at - raised_at < GRACE + 10, (raised_at, failed_at)
    assert GRACE <= stopped_at - raised_at < GRACE + 10, (raised_at, stopped_at)
    assert again.startswith("KilnError: fit() cannot run again in this process"), again
    assert "still holds it" not in proc.stderr  # rank 0 freed every group: its strategy let go of them first


def test_when_every_ranks_fit_raises_nothing_is_aborted_and_a_later_fit_trains(tmp_path):
    run_world(__file__, tmp_path, "ddp", "every", timeout=WORLD_TIMEOUT)
    (alike0, different0, kept0), (alike1, different1, kept1) = (
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    )
    alike, different = [alike0, alike1], [different0, different1]
    assert [kind for kind, _, _ in alike + different] == ["ValueError"] * 4  # each rank's own exception
    assert [message for _, message, _ in alike] == [FAILURE, FAILURE]
    assert [message for _, message, _ in different] == [f"rank {r} failed its own way at step 3" for r in (0, 1)]
    assert max(took for _, _, took in alike + different) < EVERY_GRACE / 2  # agreed, not waited out the grace
    assert kept0 and kept1  # the same group, not aborted, on both ranks
    _, model = toy.train_scenario("plain", str(tmp_path / "single"), world=1)  # a fresh run (DDP parity)
    for rank in (0, 1):
        weights = torch.load(tmp_path / f"weights{rank}.pt")
        torch.testing.assert_close(weights, toy.flat_params(model), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    worker(*sys.argv[1:])
