"""No gloo worker thread is alive when the interpreter finalizes, however the run ended (issue 35
item 15): a thread that drops a collective's last tensor then aborts the finished process
("terminate called without an active exception", exit -6). Two ways used to escape the strategy's
teardown: a process group that Transformers' TrainingArguments made before kiln looked (not kiln's
to destroy during the run), and a script destroying the group itself while FSDP still held it."""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed.conftest import real_torchrun

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)"),
]


@pytest.mark.parametrize("how", ["hf_args", "own_destroy"])
def test_no_gloo_thread_survives_into_interpreter_exit(tmp_path, how):
    if how == "hf_args":
        pytest.importorskip("transformers")
    real_torchrun("worker_exit.py", tmp_path, how, timeout=180)
    assert [json.loads((tmp_path / f"threads{rank}.json").read_text()) for rank in (0, 1)] == [0, 0]
