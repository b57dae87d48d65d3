"""`kiln fit --nproc N CONFIG ...`: start N processes on this machine with torch's elastic launcher
(exactly what `torchrun --standalone --nproc_per_node N` does), each running the same command.

Failure handling. If one rank raises or dies (even by SIGKILL), the elastic agent notices within
0.1 s and stops the others, so every rank exits and `launch_local` returns non-zero within a bounded
time. Each worker runs under a small shim (`python -m kiln.launch.worker ...`) that records the
time and message of its own failure; after the job, `launch_local` prints the failure that happened
*first*, because the errors of the other ranks (a collective that lost its peer) are consequences.

An accelerate config file (the YAML that `accelerate config` writes, e.g. the multi-GPU, FSDP and
DeepSpeed examples in the Hugging Face docs) can be honoured without accelerate installed: its
settings are read as `accelerate launch` would export them, turned into kiln settings once, and
handed to the workers as an argument (`--launcher-settings`), where the same precedence rule as for
a real `accelerate launch` applies (`kiln.launch.settings.launcher_overrides`).

Lifetime. The workers die with the launcher, even when it is killed with SIGKILL (`_die_with_launcher`);
a SIGTERM to the launcher reaches every worker and the launcher waits for their preemption checkpoint
(`_ForwardSigterm`); and nothing of the job listens beyond 127.0.0.1 (`_register_loopback`).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from typing import Any

#: set by `launch_local` for its workers only: where each rank writes its pid and, failing, its report
REPORT_DIR = "KILN_LAUNCH_REPORT_DIR"
#: set by `launch_local` for its workers only: the launcher's pid; a worker does not outlive it
LAUNCHER_PID = "KILN_LAUNCHER_PID"


def launch_local(
    nproc: int,
    argv: Sequence[str],
    *,
    extra_env: dict[str, str] | None = None,
    monitor_interval: float = 0.1,
    max_restarts: int = 0,
) -> int:
    """Run `python <argv>` (e.g. `["-m", "kiln.cli", "fit", "cfg.yaml"]`, or a script path and its
    arguments) in `nproc` local processes; returns 0, or the exit code of the first failure.

    `max_restarts`: when a worker fails, torch's agent stops the others and starts the whole group
    again, up to this many times (torchrun's `--max-restarts`); each attempt sees its number in
    TORCHELASTIC_RESTART_COUNT, and `resume_from_checkpoint: if_exists` makes it resume.

    `extra_env`: variables the outside world reads in the workers (CUDA_VISIBLE_DEVICES); kiln's own
    settings travel as arguments (see `accelerate_config_settings`)."""
    from kiln.launch.environment import detect

    if detect().distributed:
        raise RuntimeError(
            "kiln --nproc was used inside an already launched job (WORLD_SIZE is set); "
            "drop --nproc, the launcher already started the processes."
        )
    extra_env = dict(extra_env or {})
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}.")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}.")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    cores = cpu_cores()
    warn_if_more_processes_than_cores(nproc, cores)
    report_dir = tempfile.mkdtemp(prefix="kiln-launch-")
    extra_env.update(_loopback_only())
    # torch's launch_agent exports TORCHELASTIC_SIGNALS_TO_HANDLE; it is put back with the rest
    saved = {
        k: os.environ.get(k)
        for k in [REPORT_DIR, LAUNCHER_PID, "OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE", *extra_env]
    }
    os.environ.update(extra_env)
    os.environ[REPORT_DIR] = report_dir
    os.environ[LAUNCHER_PID] = str(os.getpid())
    # torchrun sets 1 thread per worker; sharing the cores is better for CPU training and harmless on GPUs.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    args = ["-u", "-m", "kiln.launch.worker", *argv]
    quiet = _QuietCtrlC()
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    sigterm = _ForwardSigterm(report_dir, nproc)
    try:
        ours = sigterm.install()  # torch's agent handles SIGTERM only where kiln cannot (not the main thread)
        config = launch_config(nproc, max_restarts, monitor_interval, handle_sigterm=not ours)
        elastic_launch(config, sys.executable)(*args)
        return 0
    except ChildFailedError as err:
        if _interrupted(err):
            return 130  # Ctrl-C: rank 0 printed the one line; the others' exits are its echo
        if sigterm.received and all(f.exitcode == -signal.SIGTERM for f in err.failures.values()):
            print(
                "kiln: stopped by SIGTERM and no checkpoint was saved; save.on_preemption: true saves one on SIGTERM "
                "once training has started.",
                file=sys.stderr,
                flush=True,
            )
            return 128 + signal.SIGTERM
        return _report(err, report_dir, attempt=max_restarts)
    except KeyboardInterrupt:  # Ctrl-C reached the launcher too (the terminal signals the whole group)
        return 130
    except Exception as err:  # noqa: BLE001 - torch's SignalException (SIGINT/SIGTERM to the launcher)
        if type(err).__name__ == "SignalException":
            return 130 if getattr(err, "sigval", None) == signal.SIGINT else 128 + int(getattr(err, "sigval", 15))
        raise
    finally:
        sigterm.uninstall()
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(report_dir, ignore_errors=True)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or `taskset`'s share), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def warn_if_more_processes_than_cores(nproc: int, cores: int) -> None:
    """One sentence when a CPU-only job starts more processes than there are cores: they would take turns on
    the cores, each step slower than with fewer processes (fine for trying out multi-process behaviour)."""
    import torch

    if nproc > cores and not torch.cuda.is_available():
        print(
            f"kiln: warning: {nproc} processes on {cores} CPU core{'s' if cores != 1 else ''} take turns on the cores, "
            f"so they train slower than {cores} process{'es' if cores != 1 else ''} (--nproc {cores}) would.",
            file=sys.stderr,
            flush=True,
        )


def launch_config(
    nproc: int, max_restarts: int = 0, monitor_interval: float = 0.1, handle_sigterm: bool = False
) -> Any:
    """torch's `LaunchConfig` for a `--nproc` job: one node, its rendezvous and the address the workers
    meet at (MASTER_ADDR) on 127.0.0.1 only; `handle_sigterm`: whether torch's agent, not kiln's
    `_ForwardSigterm`, answers SIGTERM."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend=_register_loopback(),
        local_addr=LOOPBACK,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method="spawn",
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT" if handle_sigterm else "SIGINT,SIGHUP,SIGQUIT",
    )


class _ForwardSigterm:
    """The launcher's SIGTERM handler: hands the signal to each worker and lets them finish.

    Why not torch's: its agent answers SIGTERM by signalling the workers and SIGKILLing them 30 s
    later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), so a run whose step plus checkpoint takes longer never
    saves, and the launcher exits 143 even when every worker saved and exited 0. Here the first
    SIGTERM goes to each worker's main process only (its data-loader workers must live on until the
    checkpoint is written) and the launcher waits without a kill timer: the cluster that sent the
    signal bounds the wait with its own SIGKILL. When the workers are not all running yet (nothing
    to save) or on a second SIGTERM, torch's way is taken: stop everything now."""

    def __init__(self, report_dir: str, nproc: int) -> None:
        self.report_dir, self.nproc = report_dir, nproc
        self.received = False
        self._previous: Any = None

    def install(self) -> bool:
        """Install as the SIGTERM handler; False where signals cannot be handled (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self)
        return True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def __call__(self, signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        pids = []
        for path in glob.glob(os.path.join(self.report_dir, "pid_*")):
            with open(path, encoding="utf-8") as fh:
                pids.append(int(fh.read()))
        if self.received or len(pids) < self.nproc:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        self.received = True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # already gone; the agent reports it
                pass


def _loopback_only() -> dict[str, str]:
    """Variables that keep the workers' collective sockets on the loopback interface: every rank
    runs on this machine, so nothing needs to be reachable from the network (gloo and NCCL otherwise
    listen on the address the host name resolves to). A value the user set is kept."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is None:
        return {}
    return {k: os.environ.get(k, loopback) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


_LOOPBACK_BACKEND = "kiln-loopback"
#: the only address a `--nproc` job listens on
LOOPBACK = "127.0.0.1"


def _register_loopback() -> str:
    """Register (once) and name torch's c10d rendezvous, hosted on 127.0.0.1 only.

    torch's TCPStore listens on every interface whatever host it is given, so the `c10d` backend
    with `localhost:0` (what torchrun --standalone uses) leaves two stores (the rendezvous and the
    one it shares with the workers) open to the network for the whole job. A store created on a
    socket bound to 127.0.0.1 (`master_listen_fd`) is reachable from this machine only, which is
    where every rank of a `--nproc` job runs."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_LOOPBACK_BACKEND, _loopback_handler)  # the same creator again: a no-op
    return _LOOPBACK_BACKEND


def _loopback_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # torch checks that the handler names the backend it was asked for
            return _LOOPBACK_BACKEND

    store = _loopback_store()
    handler = create_handler(store, Backend(store, params.run_id), params)
    if hasattr(handler, "_create_tcp_store_server"):  # the store torch shares with the workers (torch >= 2.4)
        handler._create_tcp_store_server = lambda *args, **kwargs: _loopback_store()  # type: ignore[method-assign]  # noqa: SLF001  # deliberate patch of torch's handler
    return handler


def _loopback_store() -> Any:
    from datetime import timedelta

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore(
        LOOPBACK,
        port,
        None,
        True,
        timedelta(seconds=60),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


_AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class _QuietCtrlC(logging.Filter):
    """Drops the elastic agent's lines about forwarding Ctrl-C (SIGINT) to the workers: rank 0 says
    where training stopped, and that one line is all a user who pressed Ctrl-C needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Received 2 death signal" in message or "closing signal SIGINT" in message)


def _interrupted(err: Any) -> bool:
    """Every failed rank exited with 130 (Ctrl-C) or was stopped by a signal after one did."""
    codes = [f.exitcode for f in err.failures.values()]
    return 130 in codes and all(c == 130 or c < 0 for c in codes)


def _report(err: Any, report_dir: str, attempt: int = 0) -> int:
    """Print which rank failed first and why in the last attempt (`attempt`, counted from 0); return
    its exit code (1 for a signal)."""
    reports = []
    for path in glob.glob(os.path.join(report_dir, "rank_*.json")):
        with open(path, encoding="utf-8") as fh:
            reports.append(json.load(fh))
    # the job failed once no restart was left: the reports of earlier (restarted) attempts are history
    reports = [r for r in reports if r.get("attempt", 0) == attempt]
    reported = {r["rank"] for r in reports}
    # A rank killed by a signal (SIGKILL: out of memory, an external kill) writes no report; the others'
    # errors then followed from its death. SIGTERM is how the agent stops the survivors: not a cause.
    signalled = {
        rank: f
        for rank, f in err.failures.items()
        if f.exitcode < 0 and f.exitcode != -signal.SIGTERM and rank not in reported
    }
    if signalled:
        rank = min(signalled)
        code = signalled[rank].exitcode
        print(
            f"kiln: rank {rank} died first (killed by signal {-code}, e.g. out of memory or an external kill); "
            "the other ranks were stopped.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if reports and len(reports) == len(err.failures) and len({(r["error"], r["exitcode"]) for r in reports}) == 1:
        print(
            f"kiln: {reports[0]['error']}\n{reports[0]['detail']}".rstrip(), file=sys.stderr, flush=True
        )  # every rank alike
        return int(reports[0]["exitcode"]) or 1
    if reports:
        # a rank stopped by a peer's failure (RankFailed, kiln/strategies/abort.py) names that peer: not a cause
        causes = [r for r in reports if "RankFailed: " not in r["error"]] or reports
        first = min(causes, key=lambda r: r["time"])
        print(
            f"kiln: rank {first['rank']} failed first (exit code {first['exitcode']}): {first['error']}\n{first['detail']}".rstrip(),
            file=sys.stderr,
            flush=True,
        )
        return int(first["exitcode"]) or 1
    rank, failure = err.get_first_failure()
    print(f"kiln: rank {rank} failed (exit code {failure.exitcode}).", file=sys.stderr, flush=True)
    return failure.exitcode if failure.exitcode > 0 else 1
