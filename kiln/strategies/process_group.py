"""Creating the default process group and picking each rank's device from the launcher's topology.
Used by the DDP-family strategies and by `main_process_first` before a Trainer exists."""

from __future__ import annotations

import gc
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from kiln.strategies.environment import ClusterEnvironment, visible_devices


def default_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def pick_device(env: ClusterEnvironment, requested: Optional[str], strategy: str = "ddp") -> torch.device:
    """cuda:<local_rank> when CUDA is usable (CUDA_VISIBLE_DEVICES already remaps the indices), else
    the CPU. `requested` is `strategy.device` ("cpu" forces the CPU on a GPU machine)."""
    kind = torch.device(requested).type if requested is not None else None
    if kind == "cpu":
        return torch.device("cpu")
    if kind not in (None, "cuda"):
        raise RuntimeError(f"strategy {strategy!r} runs on CPUs or CUDA GPUs, not on strategy.device={requested!r}; "
                           f"use strategy: {kind} (one device) or strategy.device=cpu.")
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


def init_process_group(env: ClusterEnvironment, backend: str, timeout_s: float) -> bool:
    """Create the default process group from the launcher's environment; False if one exists.

    Without a launcher (plain `python`, world size 1) a private in-memory store is used, so a
    process-group strategy also runs in one process (useful for debugging) without picking a port."""
    import torch.distributed as dist

    if dist.is_initialized():
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
        dist.init_process_group(backend, init_method=env.init_method, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return True


def barrier(device: torch.device, backend: str) -> None:
    import torch.distributed as dist

    if device.type == "cuda" and backend == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


# Objects holding the default group that the group's owner releases at teardown: (object, release).
_GROUP_USERS: list[tuple["weakref.ref[Any]", Callable[[Any], None]]] = []


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
        groups = [weakref.ref(dist.group.WORLD)]
    for ref, release in _GROUP_USERS:
        obj = ref()
        if obj is not None:
            release(obj)
    _GROUP_USERS.clear()
    dist.destroy_process_group()
    gc.collect()  # wrappers in reference cycles (modules, hooks) hold the group too
    return all(g() is None for g in groups)
