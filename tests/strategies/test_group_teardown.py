"""Teardown frees the process group, so gloo's worker threads are joined while the interpreter is
whole (issue 16: a worker that dropped the last collective's tensors during interpreter
finalization aborted a finished run with "terminate called without an active exception").

One process over an in-memory store; the threads are counted by name in /proc (Linux)."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
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
    with caplog.at_level(logging.DEBUG, logger="kiln.strategies.ddp.strategy"):
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
