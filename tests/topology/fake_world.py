"""A multi-node job faked inside one process, for the topology rules: which rank reads, writes, locks
and logs what. Two forms:

- `stand_in(rank)`: a strategy class for one place in a `nodes` x `per_node` job, alone in this
  process. Its collectives are the identity, so it trains on its own data shard as if the others
  agreed with it: enough for what one rank does by itself (its flags, its trackers, its own files).
- `ThreadWorld`: every rank of the job, each a Trainer on its own thread, with collectives that
  really exchange between the threads and barriers that wait, so that a rank that writes into the
  writer's folder finds it there. The threads share torch's RNG, so only *who does what* is asserted
  on it, never numbers.

Ranks are placed as torchrun places them: node `rank // per_node`, local rank `rank % per_node`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kiln.strategies.single import SingleDeviceStrategy


def stand_in(rank: int, per_node: int = 2, nodes: int = 2) -> type[SingleDeviceStrategy]:
    """A strategy class (Trainer(strategy=...)) for global rank `rank` of a `nodes` x `per_node` job."""
    return type(
        f"Rank{rank}Of{nodes}x{per_node}",
        (SingleDeviceStrategy,),
        {
            "world_size": nodes * per_node,
            "global_rank": rank,
            "local_rank": rank % per_node,
            "node_rank": rank // per_node,
        },
    )


class ThreadWorld:
    """`nodes` x `per_node` ranks on threads. `run(fn)` calls `fn(rank)` on every rank's thread and
    returns the results in rank order; one rank's exception breaks the others' waits and is raised."""

    def __init__(self, nodes: int = 2, per_node: int = 2, timeout: float = 120) -> None:
        self.nodes, self.per_node, self.size = nodes, per_node, nodes * per_node
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots: list[Any] = [None] * self.size
        self._here = threading.local()

    @property
    def current_rank(self) -> int | None:
        """The rank whose thread calls this (None outside `run`)."""
        return getattr(self._here, "rank", None)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (all ranks must call it)."""
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out

    def strategy(self, rank: int) -> type[SingleDeviceStrategy]:
        """The strategy class of `rank`, whose collectives go through this world."""
        world = self

        class ThreadRank(stand_in(rank, self.per_node, self.nodes)):  # type: ignore[misc]
            def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
                values = torch.stack(world.exchange(rank, torch.as_tensor(tensor).detach().clone()))
                if op == "mean":
                    return values.double().mean(0) if not values.is_floating_point() else values.mean(0)
                return values.sum(0) if op == "sum" else getattr(values, op)(0).values

            def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
                return torch.stack(world.exchange(rank, tensor.detach().clone()))

            def all_gather_object(self, obj: Any) -> list[Any]:
                return world.exchange(rank, obj)

            def broadcast_object(self, obj: Any, src: int = 0) -> Any:
                return world.exchange(rank, obj)[src]

            def barrier(self, name: str | None = None) -> None:
                world.exchange(rank, None)

        return ThreadRank

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            self._here.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                errors.append(err)
                self._barrier.abort()  # the other ranks stop waiting for this one

        threads = [threading.Thread(target=body, args=(rank,), name=f"rank{rank}") for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            raise first
        return results
