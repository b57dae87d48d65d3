"""The mesh strategy's background DCP saves stage with kiln's HostStaging (kiln/strategies/mesh/async_dcp.py):
a DTensor's copy keeps its spec around a host copy of its shard, the host buffers are reused from save to
save, and one saver writes any number of checkpoints. DCP's own DefaultStager, kept for a run, failed at the
second save on torch 2.11 (`KeyError: <class 'type'>`: it empties its type table after each stage), and a
fresh one per save pinned the whole state again each time. These tests run in a world of one process
(gloo over an in-process HashStore: no ports), with torch's real DTensors and DCP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kiln.strategies.mesh.async_dcp import AsyncDCPSaver, HostStager


@pytest.fixture
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _state(mesh: Any, value: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = distribute_tensor(torch.arange(12.0).reshape(4, 3) + value, mesh, [Shard(0)])
    return {
        "model": {"w": weight},
        "optim": {
            "state": {"w": {"step": torch.tensor(value), "exp_avg": weight * 2}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        },
    }


def test_a_dtensor_is_staged_as_a_dtensor_of_the_same_spec_around_a_host_copy_of_its_shard(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor

    state = _state(mesh, 1.0)
    staged = HostStager().stage(state)
    source, copy = state["model"]["w"], staged["model"]["w"]
    assert isinstance(copy, DTensor)
    assert copy.placements == source.placements and copy.device_mesh == source.device_mesh
    assert copy.shape == source.shape and copy.stride() == source.stride()
    assert copy._local_tensor.device.type == "cpu"
    assert copy._local_tensor.untyped_storage().data_ptr() != source._local_tensor.untyped_storage().data_ptr()
    torch.testing.assert_close(copy._local_tensor, source._local_tensor, rtol=0, atol=0)
    with torch.no_grad():
        source._local_tensor.add_(100.0)  # training changes the shard in place: the copy must not move
    assert float(copy._local_tensor[0, 0]) == 1.0
    assert staged["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert float(staged["optim"]["state"]["w"]["step"]) == 1.0


def test_the_next_stage_copies_into_the_same_host_buffers(mesh: Any) -> None:
    state = _state(mesh, 1.0)
    stager = HostStager()
    first = stager.stage(state)["model"]["w"]._local_tensor.untyped_storage().data_ptr()
    with torch.no_grad():
        state["model"]["w"]._local_tensor.add_(1.0)
    second = stager.stage(state)["model"]["w"]
    assert second._local_tensor.untyped_storage().data_ptr() == first
    assert float(second._local_tensor[0, 0]) == 2.0


def test_one_saver_writes_three_checkpoints_each_with_its_own_values(mesh: Any, tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    groups = []
    new_group = dist.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        groups.append(new_group(*args, **kwargs))
        return groups[-1]

    saver = AsyncDCPSaver()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dist, "new_group", counted)
            for value in (1.0, 2.0, 3.0):  # torch 2.11's kept DefaultStager raised at the second
                saver.save(_state(mesh, value), str(tmp_path / f"c{value:.0f}")).result()
        assert len(groups) == 1  # DCP's own gloo group: a collective, made at the first save only
        assert saver._stager.staging._buffers  # the host copies are kept for the next save ...
    finally:
        saver.close()
    assert not saver._stager.staging._buffers  # ... until the strategy's teardown lets them go
    for value in (1.0, 2.0, 3.0):
        target = _state(mesh, -50.0)
        dcp.load(target, checkpoint_id=str(tmp_path / f"c{value:.0f}"))
        expected = _state(mesh, value)
        torch.testing.assert_close(target["model"]["w"].full_tensor(), expected["model"]["w"].full_tensor())
        torch.testing.assert_close(
            target["optim"]["state"]["w"]["exp_avg"].full_tensor(),
            expected["optim"]["state"]["w"]["exp_avg"].full_tensor(),
        )
        assert float(target["optim"]["state"]["w"]["step"]) == value
