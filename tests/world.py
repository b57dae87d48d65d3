"""Start a test's N-process gloo world without paying N Python start-ups.

A world launched with `python -m torch.distributed.run` costs about 15 s of CPU before its first step on
the 2-core CI machine: the launcher imports torch (3 s), and each worker imports torch, kiln and
`torch._dynamo` (which every torch optimizer imports on construction), 5-6 s each. Most of a test's world
is that start-up. `run_world` forks the ranks from a forkserver that imported all of it once per test
process (the pattern torch's own DataLoader workers rely on: fork after `import torch`, before any
thread pool starts), and runs the worker script in each as `python script.py` would.

What each rank sees is what torchrun gives it: the same environment variables, and the rendezvous store
hosted by the launching process (TORCHELASTIC_USE_AGENT_STORE=True, as torch's elastic agent does), so
kiln's store handling runs as it does under torchrun. Tests of the launchers themselves (torchrun, `kiln
fit --nproc`, signals to an agent, restarts) keep starting the real launcher."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import runpy
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a test process's environment was when this module was imported: the forkserver is started with it,
# not with whatever a test has patched into os.environ at the moment the first world starts.
_BASE_ENV = dict(os.environ)
_PRELOAD = ["tests.world_preload"]
_GRACE_S = 10.0  # how long the other ranks get to exit after one failed, before they are killed


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    if multiprocessing.forkserver._forkserver._forkserver_pid is None:  # type: ignore[attr-defined]
        ctx.set_forkserver_preload(_PRELOAD)
        patched = dict(os.environ)
        os.environ.clear()
        os.environ.update({**_BASE_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": _python_path()})
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(patched)
    return ctx


def _python_path() -> str:
    return python_path(_BASE_ENV)


def python_path(env: Mapping[str, str] | None = None, first: str | Path = REPO) -> str:
    """`first`, then the PYTHONPATH of `env` (the test process's by default), with no empty entry: an empty
    one would put the child's working directory on its sys.path, which neither torchrun nor a user adds."""
    current = (os.environ if env is None else env).get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(first), *current.split(os.pathsep)) if p)


def _rank_main(script: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank: `python script argv...` in a process forked from the preloaded server."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: print it and exit 1
        traceback.print_exc()
        code = 1
    # What the interpreter does on its way out, in its order: wait for non-daemon threads, then atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start(proc: multiprocessing.process.BaseProcess) -> None:
    """Start a rank without multiprocessing's re-import of the launching process's main module (pytest, or a
    script): a rank runs its own script as __main__, as `python script.py` would."""
    prepare = multiprocessing.spawn.get_preparation_data

    def without_main(name: str) -> dict:
        data = prepare(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = without_main  # type: ignore[assignment]
    try:
        proc.start()
    finally:
        multiprocessing.spawn.get_preparation_data = prepare  # type: ignore[assignment]


def _torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables torchrun --standalone --nproc_per_node=N exports to each worker."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",  # the agent's, which its workers inherit
    }


def run_world(
    script: str | Path,
    *args: object,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    check: bool = True,
    cwd: str | Path = REPO,
) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks as `torchrun --standalone --nproc_per_node=nproc script args` would;
    returns a CompletedProcess (stdout and stderr: each rank's in rank order) with `.elapsed` set. With
    `check`, a rank that fails fails the test with every rank's output."""
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("localhost", 0, nproc, True, wait_for_workers=False)
    base = {**os.environ, "PYTHONPATH": _python_path(), "OMP_NUM_THREADS": "1", **(env or {})}
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"kiln-world-{uuid.uuid4().hex}"
    logs.mkdir(parents=True)
    ranks = []
    start = time.perf_counter()
    for rank in range(nproc):
        rank_env = {**base, **_torchrun_env(rank, nproc, store.port)}
        files = (str(logs / f"{rank}.out"), str(logs / f"{rank}.err"))
        proc = ctx.Process(target=_rank_main, args=(str(script), list(map(str, args)), rank_env, str(cwd), *files))
        _start(proc)
        ranks.append(proc)
    try:
        code = _wait(ranks, start + timeout)
    finally:
        for proc in ranks:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        del store
    command = ["world", f"--nproc={nproc}", str(script), *map(str, args)]
    stdout, stderr = (_joined(logs, nproc, kind) for kind in ("out", "err"))
    for path in logs.iterdir():
        path.unlink()
    logs.rmdir()
    if code is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    result = subprocess.CompletedProcess(command, code, stdout, stderr)
    result.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]
    if check and code != 0:
        import pytest

        pytest.fail(f"{' '.join(command)} exited {code}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}")
    return result


def _joined(logs: Path, nproc: int, kind: str) -> str:
    """Every rank's output of one kind, in rank order (a rank that died before it opened its file: none)."""
    paths = (logs / f"{rank}.{kind}" for rank in range(nproc))
    return "".join(path.read_text(errors="replace") for path in paths if path.exists())


def _wait(ranks: list, deadline: float) -> int | None:
    """The world's exit code as torchrun reports it (0, or the first failed rank's code), or None on timeout.
    After a rank fails the others get `_GRACE_S` to exit (they may be blocked in a collective) and are killed."""
    failed_at = None
    while True:
        codes = [proc.exitcode for proc in ranks]
        if all(code is not None for code in codes):
            return next((code for code in codes if code != 0), 0)
        now = time.perf_counter()
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None:
            failed_at = failed_at if failed_at is not None else now
            if now - failed_at > _GRACE_S:
                return failed
        if now > deadline:
            return None
        ranks[[c is None for c in codes].index(True)].join(0.05)
