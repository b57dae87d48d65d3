"""The shim each `kiln fit --nproc` worker runs under (`python -m kiln.launch.worker ARGV`): it runs
the program, records the time and message of this rank's own failure for the launcher
(kiln/launch/local.py) to report the first one, announces its pid for SIGTERM forwarding, leaves a
mark when Ctrl-C stops it (so the other ranks report the interrupt, `peer_interrupted`), and ends the
worker when the launcher dies."""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from typing import Any, TextIO

from kiln.launch.local import LAUNCHER_PID, REPORT_DIR


class _Tail:
    """Forwards writes to a stream and keeps the last few KB, so a failure report can quote the
    message the program printed before exiting (kiln's CLI prints `kiln: error: ...`)."""

    def __init__(self, stream: TextIO, limit: int = 4000) -> None:
        self.stream, self.limit, self.size = stream, limit, 0
        self.parts: deque[str] = deque()

    def write(self, text: str) -> int:
        self.parts.append(text)
        self.size += len(text)
        while self.size > self.limit and len(self.parts) > 1:
            self.size -= len(self.parts.popleft())
        return self.stream.write(text)

    def text(self) -> str:
        return "".join(self.parts)[-self.limit :]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _write_report(error: str, detail: str, exitcode: int) -> None:
    directory = os.environ.get(REPORT_DIR)
    rank = os.environ.get("RANK")
    if not directory or rank is None:
        return
    # the agent's attempt: with --max-restarts an earlier attempt's report stays in the folder, and only the last counts
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    report = {
        "rank": int(rank),
        "time": time.time(),
        "error": error,
        "detail": detail,
        "exitcode": exitcode,
        "attempt": int(attempt) if attempt.isdigit() else 0,
    }
    tmp = os.path.join(directory, f".rank_{rank}.json")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(report, fh)
    os.replace(tmp, os.path.join(directory, f"rank_{rank}.json"))


_FAILURE: list[str] = []


def report_failure(message: str) -> bool:
    """Hand `message` to kiln's launcher as this worker's failure, for it to print (once for the
    job, see `kiln.launch.local._report`) instead of every rank printing it; False outside a `kiln --nproc` worker."""
    if not os.environ.get(REPORT_DIR) or os.environ.get("RANK") is None:
        return False
    _FAILURE[:] = [message]
    return True


def _die_with_launcher() -> None:
    """End this worker when the launcher that started it dies, even by SIGKILL.

    The agent starts each worker in a session of its own, so nothing else stops it: a worker whose
    launcher was killed would train on, writing checkpoints and the export, for as long as the job
    lasts. On Linux the kernel sends SIGKILL when the parent dies (PR_SET_PDEATHSIG); "parent" is the
    thread that started the worker, which in `launch_local` is the one running the agent, and it
    returns only after the workers are gone. The launcher may die before the signal is armed, so the
    parent is checked again right after. SIGKILL, not SIGTERM: SIGTERM would start a preemption
    checkpoint, and the job it belonged to is over. Elsewhere (or when the launcher is not the direct
    parent) a daemon thread polls the launcher's pid instead."""
    raw = os.environ.get(LAUNCHER_PID)
    if not raw:
        return
    launcher, parent = int(raw), os.getppid()
    if parent == launcher and _parent_death_signal(signal.SIGKILL):
        if os.getppid() != launcher:  # it died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_watch_launcher, args=(launcher, parent), name="kiln-launcher-watch", daemon=True).start()


def _parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _watch_launcher(launcher: int, parent: int, interval: float = 1.0) -> None:
    while True:
        time.sleep(interval)
        try:
            os.kill(launcher, 0)
            alive = os.getppid() == parent
        except ProcessLookupError:
            alive = False
        except PermissionError:  # exists, owned by someone else
            alive = os.getppid() == parent
        if not alive:
            os.kill(os.getpid(), signal.SIGKILL)


def _announce() -> None:
    """Write this worker's pid where the launcher forwards SIGTERM from (`_ForwardSigterm`)."""
    directory, rank = os.environ.get(REPORT_DIR), os.environ.get("RANK")
    if directory and rank is not None:
        tmp = os.path.join(directory, f".pid_{rank}")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(os.getpid()))
        os.replace(tmp, os.path.join(directory, f"pid_{rank}"))


def _interrupt_marker(rank: str) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return os.path.join(os.environ.get(REPORT_DIR, ""), f"interrupted_{attempt}_{rank}")


def _on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C, forwarded to this worker by the agent: leave a mark for the other ranks before raising
    KeyboardInterrupt. The agent signals the workers one after the other; a rank whose own signal comes
    late sees this rank's exit first, as a collective that lost its peer, and must read it as the
    interrupt it is (`peer_interrupted`). The mark is written before this rank unwinds and closes its
    sockets, so it is there when the others' collectives fail."""
    try:
        open(_interrupt_marker(os.environ.get("RANK", "x")), "w", encoding="utf-8").close()
    except OSError:
        pass  # the launcher's folder is gone: the job is over anyway
    signal.default_int_handler(signum, frame)


def peer_interrupted() -> bool:
    """Whether a rank of this `kiln fit --nproc` job was stopped by Ctrl-C, so that an error on this
    rank (a collective that lost that peer) is the interrupt, not a failure to report. When so, this
    rank's own SIGINT, which may still be on its way, is ignored from now on: it would cut short the
    one line rank 0 prints. False outside a `kiln --nproc` worker."""
    if not os.environ.get(REPORT_DIR) or not glob.glob(_interrupt_marker("*")):
        return False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # not SIG_IGN: a pending SIGINT then prints a warning
    return True


def run_worker(argv: Sequence[str]) -> None:
    """Run `python <argv>` in this process (`-m module args` or `script.py args`), reporting a failure."""
    import runpy

    _die_with_launcher()
    _announce()
    if os.environ.get(REPORT_DIR) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    argv = list(argv)
    tail = _Tail(sys.stderr)
    sys.stderr = tail
    try:
        if argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except KeyboardInterrupt:  # Ctrl-C outside fit (imports, data building): no traceback from every rank
        raise SystemExit(130) from None
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if code and code != 130:
            lines = [line for line in tail.text().strip().splitlines() if line.strip()]
            last = _FAILURE[0] if _FAILURE else lines[-1].removeprefix("kiln: ") if lines else "no message"
            _write_report(last, "", code)
        raise
    except BaseException as err:  # noqa: BLE001 - reported, then re-raised unchanged
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):  # skip the shim
            tb = tb.tb_next
        detail = "".join(traceback.format_exception(type(err), err, tb)).splitlines()[-30:]
        _write_report(f"{type(err).__name__}: {err}", "\n".join(detail), 1)
        raise


if __name__ == "__main__":  # run from the imported module, whose state (report_failure) the program shares
    from kiln.launch import worker

    worker.run_worker(sys.argv[1:])
