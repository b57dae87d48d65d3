"""A real SIGKILL of one rank of a pipeline run (`mesh: {pp: 2}`, interleaved 1F1B: two stages a rank)
and of an expert-parallel run (`mesh: {ep: 2}`), after the run's checkpoint of step 2: rank 1 kills
itself at the start of step 3, the other rank is left in the step's collectives (and is killed, as
torchrun's agent would), and the world is started again with `resume_from_checkpoint: true`. The
restarted run resumes from checkpoint-2 and ends bitwise equal to a run that was never killed: every
rank's weights (its stages, or its expert shards and the replicated rest) and the logged losses.

heavy: two worlds of 2 gloo processes per axis (the parity tests resume a checkpoint in-process
already; this adds the killed process). Run by `run_world`, this file is the worker
(`python THIS OUT pp|ep kill|resume`)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if __name__ == "__main__":  # the world's worker: the repository root first, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.world import run_world  # noqa: E402

STRATEGY = {
    "pp": {"name": "model_parallel", "device": "cpu", "mesh": {"pp": 2}, "pipeline": {"schedule": "interleaved_1f1b"}},
    "ep": {"name": "model_parallel", "device": "cpu", "mesh": {"ep": 2}},
}
SAVE = {"save": {"strategy": "steps", "steps": 2}}


def _run(kind: str, out: str, *, seed: int, resume: Any = None, callback: Any = None) -> Any:
    """The axis's tiny model (pipeline/cases.py, experts/cases.py) trained one epoch on `kind`."""
    from kiln import Trainer
    from tests.strategies.experts import cases as expert_cases
    from tests.strategies.pipeline import cases as pipeline_cases

    cases: Any = pipeline_cases if kind == "pp" else expert_cases
    model = pipeline_cases.llama(seed=seed) if kind == "pp" else expert_cases.moe(seed=seed)
    trainer = Trainer(model, cases.config(out, STRATEGY[kind], **SAVE), train_dataset=cases.data())
    if callback is not None:
        trainer.add_callback(callback)
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def worker(out: str, kind: str, mode: str) -> None:
    from kiln import Callback

    class Kill(Callback):
        def on_step_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2 and os.environ["RANK"] == "1":  # checkpoint-2 is complete
                os.kill(os.getpid(), signal.SIGKILL)

    class ResumedAt(Callback):
        step = -1

        def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
            self.step = state.global_step

    if mode == "kill":
        _run(kind, os.path.join(out, "run"), seed=0, callback=Kill())
        raise SystemExit("not reached: rank 1 kills itself at the start of step 3, and the world goes down")
    at = ResumedAt()
    results: dict[str, Any] = {}
    for name, trainer in (  # resumed: seed 1, so the weights must come from the checkpoint
        ("resumed", lambda: _run(kind, os.path.join(out, "run"), seed=1, resume=True, callback=at)),
        ("straight", lambda: _run(kind, os.path.join(out, "straight"), seed=0)),
    ):
        done = trainer()
        state = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in done.model.state_dict().items()}
        results[name] = {
            "losses": [e["loss"] for e in done.state.log_history if "loss" in e],
            "state": {k: v.detach().clone() for k, v in state.items()},
        }
        done.teardown()
    results["resumed_at"] = at.step
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["pp", "ep"])
def test_a_rank_killed_after_a_checkpoint_resumes_bitwise(tmp_path, kind):
    killed = run_world(__file__, tmp_path, kind, "kill", check=False, timeout=300)
    assert killed.returncode != 0 and "not reached" not in killed.stderr
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]

    run_world(__file__, tmp_path, kind, "resume", timeout=300)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert got["resumed_at"] == 2
        resumed, straight = got["resumed"], got["straight"]
        assert resumed["losses"] == straight["losses"] and len(straight["losses"]) >= 3
        assert sorted(resumed["state"]) == sorted(straight["state"])
        for name, value in straight["state"].items():
            assert torch.equal(resumed["state"][name], value), f"{kind} rank {r}: {name} is not bitwise equal"


if __name__ == "__main__":
    worker(*sys.argv[1:])
