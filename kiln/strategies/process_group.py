"""Creating the default process group and picking each rank's device from the launcher's topology.
Used by the DDP-family strategies and by `main_process_first` before a Trainer exists."""

from __future__ import annotations

import atexit
import gc
import json
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from kiln.launch.environment import ClusterEnvironment, visible_devices


def default_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def pick_device(env: ClusterEnvironment, requested: str | None, strategy: str = "ddp") -> torch.device:
    """cuda:<local_rank> when CUDA is usable (CUDA_VISIBLE_DEVICES already remaps the indices), else
    the CPU. `requested` is `strategy.device` ("cpu" forces the CPU on a GPU machine)."""
    kind = torch.device(requested).type if requested is not None else None
    if kind == "cpu":
        return torch.device("cpu")
    if kind not in (None, "cuda"):
        raise RuntimeError(
            f"strategy {strategy!r} runs on CPUs or CUDA GPUs, not on strategy.device={requested!r}; "
            f"use strategy: {kind} (one device) or strategy.device=cpu."
        )
    if not torch.cuda.is_available():
        if kind == "cuda":
            raise RuntimeError(f"strategy.device is {requested!r} but CUDA is not available; use strategy.device=cpu.")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if env.local_rank < count:
        return torch.device("cuda", env.local_rank)
    if count == 1 and env.source == "slurm":  # srun bound one GPU to each task
        return torch.device("cuda", 0)
    raise RuntimeError(
        f"Local rank {env.local_rank} has no CUDA device: {count} visible (CUDA_VISIBLE_DEVICES="
        f"{visible_devices() or 'unset'}). Start at most {count} processes per node, or make more devices visible."
    )


def join_default_group(env: ClusterEnvironment, timeout_s: float = 1800) -> tuple[torch.device, str]:
    """Pick this rank's device, make it current and create the default group if none exists (for
    work before any strategy exists, e.g. `main_process_first`); returns (device, backend)."""
    device = pick_device(env, None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = default_backend(device)
    init_process_group(env, backend, timeout_s)
    return device, backend


#: default groups this process made from a launcher's rendezvous (see attempt_store's `creation`)
_GROUPS_MADE = 0


def group_incarnation() -> int:
    """How many default groups this process made from a launcher's rendezvous (the same on every rank of a
    symmetric program): what tells a group made again apart from the last one (kiln/strategies/abort.py)."""
    return _GROUPS_MADE


def init_process_group(env: ClusterEnvironment, backend: str, timeout_s: float) -> bool:
    """Create the default process group from the launcher's environment; False if one exists.

    Without a launcher (plain `python`, world size 1) a private in-memory store is used, so a
    process-group strategy also runs in one process (useful for debugging) without picking a port."""
    import torch.distributed as dist

    _destroy_at_exit()
    if dist.is_initialized():  # made by the user, or by Transformers' TrainingArguments (accelerate's PartialState)
        return False
    # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is first
    # imported (torch._dynamo imports it, e.g. while DDP is built). Imported after the group exists,
    # those defaults hold the group for good, so destroying it could not free it (see
    # destroy_default_group). Imported first, the defaults are None. It costs ~5 ms.
    import torch.distributed.nn.functional  # noqa: F401

    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1 and not env.rendezvous:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        from kiln.launch.environment import attempt_store

        # a restarted elastic attempt, and a group made again in one process, meet in a namespace of their
        # own (the keys of the last attempt or group are still in the agent's store)
        global _GROUPS_MADE
        store = attempt_store(timeout, creation=_GROUPS_MADE) if env.main_address is None else None
        _GROUPS_MADE += 1
        if store is not None:
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=env.init_method, rank=env.rank, world_size=env.world_size, timeout=timeout
            )
        _leave_identity(env)
    return True


# -- naming a rank that died -----------------------------------------------------------------------
# Without a launcher agent (srun, processes started by hand) nobody says which rank died: a survivor
# only sees its collective fail ("Connection reset by peer" from gloo). Each rank therefore leaves its
# host and pid in the job's store at start-up, under its host's name, so that a survivor can tell
# which of the ranks on its own machine are gone. Ranks on other machines are named by their own
# neighbours. The store is read only after an error, and only for this machine's ranks.
_IDENTITY: dict[str, Any] = {}


def _key(host: str, local_rank: int) -> str:
    return f"kiln/ranks/{host}/{local_rank}"


def _leave_identity(env: ClusterEnvironment) -> None:
    import psutil

    host, pid = socket.gethostname(), os.getpid()
    store = default_store()
    if store is None:
        return
    store.set(_key(host, env.local_rank), json.dumps([env.rank, pid, psutil.Process(pid).create_time()]))
    if env.rank == 0:  # without a launcher agent rank 0 hosts the store; with one, the agent does
        port = getattr(getattr(store, "_underlying_non_prefix_store", None), "port", None)
        listening = {
            c.laddr.port for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN
        }
        store.set("kiln/ranks/store_on_rank0", "1" if port in listening else "0")
    _IDENTITY.update(
        host=host,
        rank=env.rank,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        store_on_rank0=store.get("kiln/ranks/store_on_rank0") == b"1",
    )
    if not getattr(sys.excepthook, "_kiln_lost_peers", False):
        sys.excepthook = _naming_excepthook(sys.excepthook)


#: the store of a default group that kiln aborted (kiln/strategies/abort.py), still needed after it
_KEPT_STORE: list[Any] = []


def default_store() -> Any:
    """The default group's store (the job's, prefixed for this group); after an abort, the aborted group's
    (`keep_default_store`); else None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):  # no default group (or another torch layout)
        return _KEPT_STORE[-1] if _KEPT_STORE else None


def keep_default_store() -> Any:
    """Keep the default group's store beyond the group (returned): a store this rank hosts (no launcher
    agent: rank 0) keeps answering the peers, and `lost_peer_note` can still read the ranks' identities."""
    store = default_store()
    if store is not None and store not in _KEPT_STORE:
        _KEPT_STORE.append(store)
    return store


def lost_peer_note(timeout_s: float = 5.0, dying_s: float = 2.0) -> str | None:
    """One sentence naming the ranks of this machine that died (or the store's host, when the store
    no longer answers), for an error that followed from their death; None when none can be named."""
    if not _IDENTITY or default_store() is None:
        return None
    store, me = default_store(), _IDENTITY
    dead: list[str] = []
    dying_until = time.monotonic() + dying_s  # one wait for all peers: a healthy job's error is not held up long
    try:
        store.set_timeout(timedelta(seconds=timeout_s))
        for local_rank in range(me["local_world_size"]):
            if local_rank == me["local_rank"]:
                continue
            rank, pid, started = json.loads(store.get(_key(me["host"], local_rank)))
            if not _alive_after(pid, started, dying_until):
                dead.append(f"rank {rank} (pid {pid})")
    except Exception:  # noqa: BLE001 - the store is gone too (DistStoreError, timeouts, resets)
        if me["store_on_rank0"] and me["rank"] != 0:
            return (
                f"kiln: rank 0, which hosts the job's store, no longer answers; this error on rank {me['rank']} "
                "followed from losing it. Look at rank 0's output for the cause."
            )
        return None
    if not dead:
        return None
    return (
        f"kiln: {', '.join(dead)} on this machine died; this error on rank {me['rank']} followed from it. Look at "
        "that rank's output for the cause (no output: it was killed, e.g. by the out-of-memory killer)."
    )


def _alive_after(pid: int, started: float, deadline: float) -> bool:
    """Whether process `pid` (started at `started`) is still alive at `deadline` (time.monotonic). A
    killed peer closes its sockets before it turns into a zombie, so its death reaches us while it
    still looks alive for a moment (long on a loaded machine): give it until then to finish dying."""
    import psutil

    while True:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) >= 1 or proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return False
        except psutil.NoSuchProcess:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


def _naming_excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    """An uncaught collective error (a RuntimeError) gets a note naming the dead rank, printed under it."""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, RuntimeError):
            try:
                note = lost_peer_note()
            except Exception:  # noqa: BLE001 - the note is a courtesy; the error must still be printed
                note = None
            if note and hasattr(value, "add_note"):  # Python >= 3.11: printed under the error
                value.add_note(note)
            elif note:
                print(note, file=sys.stderr)
        previous(kind, value, tb)

    hook._kiln_lost_peers = True  # type: ignore[attr-defined]
    return hook


def barrier(device: torch.device, backend: str) -> None:
    import torch.distributed as dist

    if device.type == "cuda" and backend == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


# Objects holding the default group that the group's owner releases at teardown: (object, release).
_GROUP_USERS: list[tuple[weakref.ref[Any], Callable[[Any], None]]] = []


def register_group_user(obj: Any, release: Callable[[Any], None]) -> None:
    """Let `destroy_default_group` call `release(obj)` (drop its references to the group) if `obj`
    is still alive then, e.g. a DDP wrapper the Trainer keeps after training."""
    _GROUP_USERS[:] = [(ref, fn) for ref, fn in _GROUP_USERS if ref() is not None]  # runs come and go (hp search)
    _GROUP_USERS.append((weakref.ref(obj), release))


def destroy_default_group() -> bool:
    """Destroy the default group (and every group made from it) and free them now; True when all
    were freed.

    Why freeing matters (issue 16): a gloo worker thread drops its reference to a collective's
    tensors just after the collective completes. When the caller has already let go of a tensor,
    that last drop frees it, which needs the GIL; if the interpreter is finalizing by then, CPython
    ends the thread inside a noexcept C++ frame and the process dies with "terminate called without
    an active exception". Freeing the group runs ProcessGroupGloo's destructor, which drains the
    queue and joins the workers (with the GIL released), so nothing is left in flight at exit."""
    import torch.distributed as dist

    try:
        from torch.distributed.distributed_c10d import _world

        groups = [weakref.ref(g) for g in _world.pg_map]  # no strong reference kept here
    except (ImportError, AttributeError):  # another torch layout: the default group at least
        groups = [weakref.ref(g) for g in (dist.group.WORLD,) if g is not None]
    for ref, release in _GROUP_USERS:
        obj = ref()
        if obj is not None:
            release(obj)
    _GROUP_USERS.clear()
    if dist.is_initialized():  # else destroyed already, e.g. by a script's own destroy_process_group()
        dist.destroy_process_group()
    gc.collect()  # wrappers in reference cycles (modules, hooks) hold the group too
    return all(g() is None for g in groups)


_EXIT_HOOK: list[bool] = []


def _destroy_at_exit() -> None:
    """Free every process group before the interpreter finalizes, whoever made it (once per process).

    The strategy that creates the group tears it down (and registers that with atexit), but two
    cases escaped it (issue 35 item 15): a group that existed before kiln looked, which the strategy
    does not own and so never destroyed, as `TrainingArguments(...)` creates one under torchrun
    (accelerate's PartialState); and a script that calls `dist.destroy_process_group()` itself,
    which leaves the groups alive in the sharded module (FSDP) and makes the strategy's teardown see
    no group. Either way gloo's worker threads outlived the interpreter (see destroy_default_group).
    Registered before the strategy's own teardown, this runs after it: usually nothing is left."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(_teardown_at_exit)


def _teardown_at_exit() -> None:
    import torch.distributed as dist

    if not dist.is_initialized() and not _GROUP_USERS:
        return
    _drop_late_defaults()
    if not destroy_default_group():
        import time

        time.sleep(0.2)  # something unknown holds a group: let its workers finish while the interpreter is whole


def _drop_late_defaults() -> None:
    """torch.distributed.nn.functional imported after the group existed binds it as default arguments
    (see init_process_group); at exit nothing calls those functions, so the defaults can go."""
    import torch.distributed as dist

    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(defaults, tuple) and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
