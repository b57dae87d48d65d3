"""Teardown frees the process group, so gloo's worker threads are joined while the interpreter is
whole (issue 16: a worker that dropped the last collective's tensors during interpreter
finalization aborted a finished run with "terminate called without an active exception").

Also the rest of kiln/strategies/process_group.py that one process can check: the exit hook frees a
group kiln did not make, barrier() names the GPU to NCCL only, and the note naming a dead peer.

One process over an in-memory store; the threads are counted by name in /proc (Linux)."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kiln import Trainer
from tests.helpers import TinyRegressor, base_config, regression_data
from tests.strategies.test_ddp_strategy import LAUNCH_VARS, no_launcher  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")


def gloo_workers() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended while listing
            pass
    return names.count("pt_gloo_runloop")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_teardown_frees_the_group_and_joins_gloo_workers(tmp_path, strategy, caplog):
    gc.collect()  # groups an earlier test left in reference cycles
    before = gloo_workers()
    cfg = base_config(tmp_path, strategy={"name": strategy, "device": "cpu"}, train={"max_steps": 2})
    trainer = Trainer(TinyRegressor(), config=cfg, train_dataset=regression_data(16))
    trainer.fit()
    group = weakref.ref(dist.group.WORLD)
    assert gloo_workers() > before  # the run's group has its workers
    with caplog.at_level(logging.DEBUG, logger="kiln.strategies.collectives"):
        trainer.strategy.teardown()
    assert "outlives" not in caplog.text  # freed by teardown itself, not by the fallback
    gc.collect()
    # the Trainer (and its wrapped model) is still alive here, as it is in a script at exit
    assert group() is None, "the process group outlived teardown"
    assert gloo_workers() <= before  # its workers were joined (fewer: an earlier test's leftovers freed too)


def test_group_is_freed_when_dynamo_is_first_imported_after_it(tmp_path):
    """torch.distributed.nn.functional binds the default group as default arguments when first
    imported; a fresh interpreter imports it (through torch._dynamo) only after the group exists."""
    script = textwrap.dedent(f"""
        import gc, sys, weakref
        sys.path.insert(0, {os.getcwd()!r})
        assert "torch._dynamo" not in sys.modules
        import torch.distributed as dist
        from kiln.config import load_config
        from kiln.precision import build_precision
        from kiln.strategies.ddp.strategy import DDPStrategy
        config = load_config({{"strategy": {{"name": "ddp", "device": "cpu"}}, "output_dir": {str(tmp_path)!r}}})
        strategy = DDPStrategy(config, build_precision(config))
        strategy.setup_environment()
        group = weakref.ref(dist.group.WORLD)
        import torch._dynamo  # noqa: F401
        strategy.teardown()
        gc.collect()
        print("freed" if group() is None else "alive")
    """)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "freed"


def test_at_exit_a_group_kiln_did_not_make_is_freed_too(monkeypatch):
    """A group made before kiln looked (TrainingArguments under torchrun) has no strategy to tear it
    down, nor any kiln wrapper holding it: the exit hook destroys it, so gloo's workers do not outlive
    the interpreter (issue 35)."""
    from kiln.strategies import process_group

    monkeypatch.setattr(process_group, "_GROUP_USERS", [])  # no DDP/FSDP wrapper of an earlier test's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = weakref.ref(dist.group.WORLD)
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    process_group._teardown_at_exit()
    gc.collect()
    assert not dist.is_initialized() and group() is None
    assert slept == []  # freed: nothing is left to wait for before the interpreter finalizes


@pytest.mark.parametrize(
    "device, backend, kwargs",
    [
        (torch.device("cuda", 1), "nccl", {"device_ids": [1]}),  # NCCL's barrier on this rank's own GPU
        (torch.device("cpu"), "gloo", {}),
        (torch.device("cuda", 1), "gloo", {}),
    ],
)
def test_barrier_names_the_gpu_only_to_nccl(monkeypatch, device, backend, kwargs):
    from kiln.strategies.process_group import barrier

    calls = []
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    barrier(device, backend)
    assert calls == [kwargs]


def test_the_lost_peer_note_names_the_dead_ranks_of_this_machine_and_never_itself(monkeypatch):
    """What a survivor adds to a collective's error (no launcher agent to say it): its neighbours on this
    host whose process is gone, read from the identities every rank left in the store."""
    import json

    import psutil

    from kiln.strategies import process_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    me = os.getpid()
    monkeypatch.setattr(
        process_group,
        "_IDENTITY",
        {"host": "h", "rank": 4, "local_rank": 0, "local_world_size": 3, "store_on_rank0": False},
    )
    store = process_group.default_store()
    store.set("kiln/ranks/h/0", json.dumps([4, me, psutil.Process(me).create_time()]))  # this rank, alive
    store.set("kiln/ranks/h/1", json.dumps([5, me, 0.0]))  # its pid now belongs to another process: dead
    store.set("kiln/ranks/h/2", json.dumps([6, me, psutil.Process(me).create_time()]))  # alive
    assert process_group.lost_peer_note(dying_s=0) == (
        f"kiln: rank 5 (pid {me}) on this machine died; this error on rank 4 followed from it. Look at that rank's "
        "output for the cause (no output: it was killed, e.g. by the out-of-memory killer)."
    )


def test_a_rank_leaves_its_identity_and_its_error_hook_adds_the_note_once(monkeypatch):
    """At start-up each rank leaves (rank, pid) in the store and wraps sys.excepthook once (a second
    group in the same process must not wrap it again): an uncaught collective error then carries one note
    naming the dead neighbour, and is still printed by the previous hook."""
    import json
    import socket

    from kiln.launch.environment import ClusterEnvironment
    from kiln.strategies import process_group

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(value))
    monkeypatch.setattr(process_group, "_IDENTITY", {})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    process_group.default_store().set_timeout(timedelta(seconds=5))  # a key rank 0 failed to leave: fail, not hang
    env = ClusterEnvironment(world_size=2, rank=0, local_rank=0, local_world_size=2)
    process_group._leave_identity(env)
    process_group._leave_identity(env)
    store, me = process_group.default_store(), os.getpid()
    assert json.loads(store.get(f"kiln/ranks/{socket.gethostname()}/0"))[:2] == [0, me]
    store.set(
        f"kiln/ranks/{socket.gethostname()}/1", json.dumps([1, me, 0.0])
    )  # rank 1: its pid is another process now
    err = RuntimeError("Connection reset by peer")
    sys.excepthook(RuntimeError, err, None)
    assert printed == [err]
    assert err.__notes__ == [
        f"kiln: rank 1 (pid {me}) on this machine died; this error on rank 0 followed from it. Look "
        "at that rank's output for the cause (no output: it was killed, e.g. by the out-of-memory killer)."
    ]


def test_at_exit_groups_a_script_destroyed_itself_are_released_from_their_holders(monkeypatch):
    """A script that calls dist.destroy_process_group() itself leaves the group alive inside the objects
    kiln registered as its users (FSDP's sharded module): the exit hook still releases them (issue 35)."""
    from kiln.strategies import process_group

    class Holder:  # what a sharded module is to the group
        pass

    monkeypatch.setattr(process_group, "_GROUP_USERS", [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    holder = Holder()
    holder.group = dist.group.WORLD
    process_group.register_group_user(holder, lambda obj: vars(obj).clear())
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()  # the script's own call
    gc.collect()
    assert group() is not None  # still held
    process_group._teardown_at_exit()
    gc.collect()
    assert group() is None


def test_a_failed_fit_on_one_process_aborts_nothing(tmp_path):
    """`stopping_peers` (kiln/engine/loop/fit_errors.py) on a process-group strategy of one process: no peer to
    stop, so the group stays for whatever the script does next."""
    from kiln import Callback

    class Fail(Callback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            raise ValueError("boom")

    cfg = base_config(tmp_path, strategy={"name": "ddp", "device": "cpu"}, train={"max_steps": 2})
    trainer = Trainer(TinyRegressor(), config=cfg, train_dataset=regression_data(16), callbacks=[Fail()])
    with pytest.raises(ValueError, match="^boom$"):
        trainer.fit()
    assert dist.is_initialized() and not trainer.strategy.aborted
    trainer.strategy.teardown()
