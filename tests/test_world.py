"""tests/world.py, the harness most multi-process tests start their worlds with: a rank sees what torchrun
gives it, and a rank that fails, exits or hangs is reported as torchrun reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import world
from tests.distributed.conftest import run

pytestmark = pytest.mark.distributed

PROBE = """
import atexit, json, os, sys

seen = dict(os.environ)
seen["MASTER_PORT"] = seen["MASTER_PORT"].isdigit()
seen["TORCHELASTIC_RUN_ID"] = bool(seen["TORCHELASTIC_RUN_ID"])
seen["argv"], seen["main"], seen["path0"] = sys.argv[1:], __name__, sys.path[0]
out = os.path.join({out!r}, os.environ["RANK"] + ".json")
atexit.register(lambda: open(out, "w").write(json.dumps(seen)))  # written on the way out, as a script's atexit is
"""


def _probe(tmp_path, name: str):
    (tmp_path / name).mkdir()
    script = tmp_path / name / "probe.py"
    script.write_text(textwrap.dedent(PROBE.format(out=str(tmp_path / name))))
    return script


def test_a_rank_sees_the_environment_argv_and_main_that_torchrun_gives_it(tmp_path):
    real = _probe(tmp_path, "real")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(real), "a", "1"])
    ours = _probe(tmp_path, "ours")
    world.run_world(ours, "a", 1)
    for rank in (0, 1):
        # what the launcher changed in the environment the test process has, and what the script sees
        want, got = (
            {
                k: v
                for k, v in json.loads((tmp_path / name / f"{rank}.json").read_text()).items()
                if os.environ.get(k) != v
            }
            for name in ("real", "ours")
        )
        want["path0"] = want["path0"].replace("/real", "/ours")
        want.pop("TORCHELASTIC_ERROR_FILE", None)  # torchrun's own error-record file; kiln never reads it
        assert got == want


def test_a_failing_rank_fails_the_world_with_its_error_and_its_hung_peer_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(world, "_GRACE_S", 0.5)
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('rank one broke')\n"
        "time.sleep(600)  # a peer blocked in a collective that will never complete\n"
    )
    proc = world.run_world(script, check=False, timeout=60)
    assert proc.returncode == 1
    assert "ValueError: rank one broke" in proc.stderr
    assert proc.elapsed < 30


def test_sys_exit_codes_come_back_and_a_hung_world_times_out(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '0' else 0)\n")
    proc = world.run_world(script, check=False)
    assert (proc.returncode, proc.stderr) == (3, "")
    script.write_text("import os, sys\nsys.exit(int(os.environ['RANK']))\n")  # the failed rank's code, not rank 0's
    assert world.run_world(script, check=False).returncode == 1
    script.write_text("import sys\nsys.exit('a message')\n")  # as the interpreter: printed, exit 1
    proc = world.run_world(script, check=False, nproc=1)
    assert (proc.returncode, proc.stderr) == (1, "a message\n")
    # a non-daemon thread still running when the script ends is waited for, as the interpreter waits
    script.write_text(
        "import sys, threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
    )
    assert world.run_world(script, nproc=1).stdout == "thread done\n"
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        world.run_world(script, timeout=2)
