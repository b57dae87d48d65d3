"""`kiln fit --nproc N CONFIG ...`: start N processes on this machine with torch's elastic launcher
(exactly what `torchrun --standalone --nproc_per_node N` does), each running the same command.

Failure handling. If one rank raises or dies (even by SIGKILL), the elastic agent notices within
0.1 s and stops the others, so every rank exits and `launch_local` returns non-zero within a bounded
time. Each worker runs under a small shim (`python -m kiln.strategies.launch ...`) that records the
time and message of its own failure; after the job, `launch_local` prints the failure that happened
*first*, because the errors of the other ranks (a collective that lost its peer) are consequences.

An accelerate config file (the YAML that `accelerate config` writes, e.g. the multi-GPU, FSDP and
DeepSpeed examples in the Hugging Face docs) can be honoured without accelerate installed: its
settings are read as `accelerate launch` would export them, turned into kiln settings once, and
handed to the workers as an argument (`--launcher-settings`), where the same precedence rule as for
a real `accelerate launch` applies (`launcher_settings.launcher_overrides`).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections import deque
from typing import Any, Optional, Sequence, TextIO

#: set by `launch_local` for its workers only: where each failing rank writes its report
REPORT_DIR = "KILN_LAUNCH_REPORT_DIR"


def launch_local(
    nproc: int,
    argv: Sequence[str],
    *,
    extra_env: Optional[dict[str, str]] = None,
    monitor_interval: float = 0.1,
) -> int:
    """Run `python <argv>` (e.g. `["-m", "kiln.cli", "fit", "cfg.yaml"]`, or a script path and its
    arguments) in `nproc` local processes; returns 0, or the exit code of the first failure.

    `extra_env`: variables the outside world reads in the workers (CUDA_VISIBLE_DEVICES); kiln's own
    settings travel as arguments (see `accelerate_config_settings`)."""
    from kiln.strategies.environment import detect

    if detect().distributed:
        raise RuntimeError("kiln --nproc was used inside an already launched job (WORLD_SIZE is set); "
                           "drop --nproc, the launcher already started the processes.")
    extra_env = dict(extra_env or {})
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}.")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    report_dir = tempfile.mkdtemp(prefix="kiln-launch-")
    saved = {k: os.environ.get(k) for k in [REPORT_DIR, "OMP_NUM_THREADS", *extra_env]}
    os.environ.update(extra_env)
    os.environ[REPORT_DIR] = report_dir
    # torchrun sets 1 thread per worker; sharing the cores is better for CPU training and harmless on GPUs.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
        rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=monitor_interval, start_method="spawn",
    )
    args = ["-u", "-m", "kiln.strategies.launch", *argv]
    quiet = _QuietCtrlC()
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        elastic_launch(config, sys.executable)(*args)
        return 0
    except ChildFailedError as err:
        if _interrupted(err):
            return 130  # Ctrl-C: rank 0 printed the one line; the others' exits are its echo
        return _report(err, report_dir)
    except KeyboardInterrupt:  # Ctrl-C reached the launcher too (the terminal signals the whole group)
        return 130
    except Exception as err:  # noqa: BLE001 - torch's SignalException (SIGINT/SIGTERM to the launcher)
        if type(err).__name__ == "SignalException":
            return 130 if getattr(err, "sigval", None) == signal.SIGINT else 128 + int(getattr(err, "sigval", 15))
        raise
    finally:
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(report_dir, ignore_errors=True)


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


def _report(err: Any, report_dir: str) -> int:
    """Print which rank failed first and why; return its exit code (1 for a signal)."""
    reports = []
    for path in glob.glob(os.path.join(report_dir, "rank_*.json")):
        with open(path, encoding="utf-8") as fh:
            reports.append(json.load(fh))
    reported = {r["rank"] for r in reports}
    # A rank killed by a signal (SIGKILL: out of memory, an external kill) writes no report; the others'
    # errors then followed from its death. SIGTERM is how the agent stops the survivors: not a cause.
    signalled = {rank: f for rank, f in err.failures.items()
                 if f.exitcode < 0 and f.exitcode != -signal.SIGTERM and rank not in reported}
    if signalled:
        rank = min(signalled)
        code = signalled[rank].exitcode
        print(f"kiln: rank {rank} died first (killed by signal {-code}, e.g. out of memory or an external kill); "
              "the other ranks were stopped.", file=sys.stderr, flush=True)
        return 1
    if reports:
        first = min(reports, key=lambda r: r["time"])
        print(f"kiln: rank {first['rank']} failed first (exit code {first['exitcode']}): {first['error']}\n{first['detail']}".rstrip(),
              file=sys.stderr, flush=True)
        return int(first["exitcode"]) or 1
    rank, failure = err.get_first_failure()
    print(f"kiln: rank {rank} failed (exit code {failure.exitcode}).", file=sys.stderr, flush=True)
    return failure.exitcode if failure.exitcode > 0 else 1


def accelerate_config_settings(path: str) -> tuple[int, list[Any], dict[str, str]]:
    """(num_processes, the kiln settings an `accelerate config` file asks for, the device variables
    the workers' torch must see): what `kiln fit --accelerate-config FILE` hands its workers."""
    from kiln.strategies.launcher_settings import accelerate_settings

    num, env = accelerate_config_env(path)
    devices = {k: v for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES"}
    return num, accelerate_settings(env), devices


def accelerate_config_env(path: str) -> tuple[int, dict[str, str]]:
    """(num_processes, the variables `accelerate launch --config_file PATH` would export)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise ValueError(f"accelerate config {path!r} must hold a mapping.")
    if int(raw.get("num_machines", 1) or 1) > 1:
        raise ValueError(f"accelerate config {path!r} describes {raw['num_machines']} machines, but `kiln --nproc` starts "
                         "processes on this machine only: run `accelerate launch` (or torchrun) on every node instead.")
    env = {"ACCELERATE_MIXED_PRECISION": str(raw.get("mixed_precision") or "no").lower(),
           "ACCELERATE_USE_CPU": str(bool(raw.get("use_cpu", False))).lower()}
    kind = str(raw.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
        renamed = {"FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP": "FSDP_TRANSFORMER_CLS_TO_WRAP",
                   "FSDP_BACKWARD_PREFETCH_POLICY": "FSDP_BACKWARD_PREFETCH"}
        for key, value in (raw.get("fsdp_config") or {}).items():
            name = key.upper() if key.upper().startswith("FSDP_") else f"FSDP_{key.upper()}"
            env[renamed.get(name, name)] = str(value).lower() if isinstance(value, bool) else str(value)
    elif kind == "DEEPSPEED":
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        names = {"deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE", "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                 "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                 "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                 "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                 "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING"}
        env.update({names[k]: str(v) for k, v in (raw.get("deepspeed_config") or {}).items() if k in names and v is not None})
    dynamo = raw.get("dynamo_config") or {}
    if dynamo.get("dynamo_backend"):
        env["ACCELERATE_DYNAMO_BACKEND"] = str(dynamo["dynamo_backend"]).upper()
        if dynamo.get("dynamo_mode"):
            env["ACCELERATE_DYNAMO_MODE"] = str(dynamo["dynamo_mode"])
    gpu_ids = raw.get("gpu_ids")
    if gpu_ids not in (None, "", "all") and not raw.get("use_cpu"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    return int(raw.get("num_processes") or 1), env


# -- the worker shim -------------------------------------------------------------------------------
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
        return "".join(self.parts)[-self.limit:]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _write_report(error: str, detail: str, exitcode: int) -> None:
    directory = os.environ.get(REPORT_DIR)
    rank = os.environ.get("RANK")
    if not directory or rank is None:
        return
    report = {"rank": int(rank), "time": time.time(), "error": error, "detail": detail, "exitcode": exitcode}
    tmp = os.path.join(directory, f".rank_{rank}.json")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(report, fh)
    os.replace(tmp, os.path.join(directory, f"rank_{rank}.json"))


def run_worker(argv: Sequence[str]) -> None:
    """Run `python <argv>` in this process (`-m module args` or `script.py args`), reporting a failure."""
    import runpy

    argv = list(argv)
    tail = _Tail(sys.stderr)
    sys.stderr = tail  # type: ignore[assignment]
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
            last = lines[-1].removeprefix("kiln: ") if lines else "no message"
            _write_report(last, "", code)
        raise
    except BaseException as err:  # noqa: BLE001 - reported, then re-raised unchanged
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):  # skip the shim
            tb = tb.tb_next
        detail = "".join(traceback.format_exception(type(err), err, tb)).splitlines()[-30:]
        _write_report(f"{type(err).__name__}: {err}", "\n".join(detail), 1)
        raise


if __name__ == "__main__":
    run_worker(sys.argv[1:])
