"""One 2-process DeepSpeed world for the test files of this folder that read a 2-process worker's results
(worker_chain.py runs their workers one after another): the files carry the same xdist group, and each
names its worker in `WORLD_JOB`; the world runs the jobs of the files this session selected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: the order the workers run in: worker_model_building.py first, while no ZeRO-3 config is registered with
#: Transformers (a DeepSpeed strategy leaves its config registered for the life of the process, as HF's Trainer)
ORDER = ("worker_model_building.py", "worker.py", "worker_schedule_and_files.py", "worker_zero3.py")


@pytest.fixture(scope="session")
def ds_world(request, tmp_path_factory):
    """WORLD_JOB -> (results.json, tensors.safetensors) of that worker, run in the shared world on first use."""
    root = tmp_path_factory.mktemp("ds_world")
    jobs = {item.module.WORLD_JOB for item in request.session.items if "ds_world" in item.fixturenames}
    done: dict[str, str] = {}

    def out(job: tuple[str, ...]) -> Path:
        return root / Path(job[0]).stem

    def get(job: tuple[str, ...]) -> tuple[dict, dict]:
        if not done:
            from tests.strategies.deepspeed.launch import start

            args: list[str] = []
            for j in sorted(jobs | {job}, key=lambda j: ORDER.index(j[0])):
                args += [*(["+"] if args else []), j[0], str(out(j)), *j[1:]]
            try:
                start("worker_chain.py", *args)
                done["ok"] = ""
            except BaseException as err:  # pytest.fail: every later test reads the same failure
                done["failed"] = str(err)
        if "failed" in done:
            pytest.fail(done["failed"])
        if (out(job) / "error.txt").exists():
            pytest.fail(f"{job[0]} failed in the shared DeepSpeed world:\n{(out(job) / 'error.txt').read_text()}")
        from safetensors.torch import load_file

        return json.loads((out(job) / "results.json").read_text()), load_file(str(out(job) / "tensors.safetensors"))

    return get
