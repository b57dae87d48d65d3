"""The kernel choice for param groups that mix meshes (kiln/utils/kernels.py), on stand-ins: parameters
whose `device_mesh` plays a DTensor's. A real tp-split model trains through it in
tests/strategies/model_parallel (the `hook` case, its configure_optimizers under torch's CUDA default)."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.utils.errors import ConfigError
from kiln.utils.kernels import mixes_meshes, per_parameter_kernels_where_mixed


def _param(mesh: object = None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(2))
    if mesh is not None:
        p.device_mesh = mesh  # what a DTensor carries
    return p


MESH_A, MESH_B = object(), object()


@pytest.mark.parametrize(
    "meshes,mixed",
    [
        ((None, None), False),
        ((MESH_A, MESH_A), False),
        ((MESH_A, None), True),
        ((None, MESH_A), True),
        ((MESH_A, MESH_B), True),
        ((), False),
    ],
)
def test_a_group_mixes_when_its_parameters_do_not_share_one_mesh(meshes, mixed):
    assert mixes_meshes([_param(m) for m in meshes]) is mixed


class _Equal:
    """A mesh equal to every other _Equal, as two DeviceMesh objects of the same ranks and names are."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Equal)

    def __hash__(self) -> int:
        return 1


def test_equal_meshes_are_one_mesh_though_they_are_distinct_objects():
    """A second mesh run in one process gets some of its DeviceMesh objects from torch's caches and some new,
    equal ones. Told apart by identity, they switched AdamW's fused kernel off for that run only, and its
    weights differed from `single`'s in the last bit (a test order broke an FSDP-vs-single bitwise check)."""
    assert mixes_meshes([_param(_Equal()), _param(_Equal())]) is False
    assert mixes_meshes([_param(_Equal()), _param()]) is True


def test_two_device_meshes_of_the_same_ranks_and_names_are_one_mesh():
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        first, second = (DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp_shard",)) for _ in range(2))
        other = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",))
        assert first is not second
        assert mixes_meshes([_param(first), _param(second)]) is False
        assert mixes_meshes([_param(first), _param(other)]) is True
    finally:
        dist.destroy_process_group()


def test_only_the_mixed_groups_left_to_torch_step_per_parameter(caplog):
    mixed, plain, asked_off = [_param(MESH_A), _param()], [_param(), _param()], [_param(MESH_A), _param(MESH_B)]
    opt = torch.optim.AdamW([{"params": mixed}, {"params": plain}, {"params": asked_off, "foreach": False}])
    with caplog.at_level(logging.INFO, logger="kiln.utils.kernels"):
        per_parameter_kernels_where_mixed(opt)
    assert [g["foreach"] for g in opt.param_groups] == [False, None, False]
    assert "Param group 0 of the AdamW optimizer mixes DTensors" in caplog.text
    assert "group 1" not in caplog.text and "group 2" not in caplog.text


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_a_mixed_group_that_asks_for_a_multi_tensor_kernel_is_one_sentence(flag):
    opt = torch.optim.AdamW([{"params": [_param()]}, {"params": [_param(MESH_A), _param()]}], **{flag: True})
    with pytest.raises(
        ConfigError,
        match=rf"^Param group 1 of the AdamW optimizer mixes DTensors .* its {flag}=True "
        rf"kernel cannot step in one call; build it with {flag}=False",
    ):
        per_parameter_kernels_where_mixed(opt)


def test_an_optimizer_without_a_kernel_choice_is_left_alone():
    class Plain(torch.optim.Optimizer):  # a user's optimizer with no foreach setting
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    opt = Plain([_param(MESH_A), _param()])
    per_parameter_kernels_where_mixed(opt)
    assert "foreach" not in opt.param_groups[0]
    per_parameter_kernels_where_mixed(object())  # LOMO-style objects without param_groups
