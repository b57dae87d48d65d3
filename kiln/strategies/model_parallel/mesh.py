"""The mesh of `strategy: model_parallel`: its four named axes, read from the config and checked
against the world size before any process group starts, and the rank arithmetic built on them.

Axes, outermost first (torchtitan's ParallelDims and accelerate's ParallelismConfig order):
`dp_replicate` (replicas of the sharded model), `dp_shard` (FSDP2 shards the parameters over it),
`cp` (context parallel: refused, see `check_cp`) and `tp` (tensor parallel, innermost so one TP group
is neighbouring ranks, on one node). Ranks fill the mesh in that row-major order, so the data shard
of rank r is r // (cp * tp): the `cp * tp` ranks of one data shard read the same batches.

Written as `mesh: {dp_replicate: 1, dp_shard: 2, tp: 2}`; missing axes are 1 and one axis may be -1
(the rest of the world). HF's `parallelism_config` (accelerate's ParallelismConfig, or a mapping with
its `*_size` keys) becomes the same mapping (kiln.config.hf_rewrites.parallelism_config)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kiln.utils.errors import ConfigError

#: the axes, outermost first; mesh dimension names as torch's DeviceMesh gets them
AXES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """The resolved sizes of the four axes (their product is the world size)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of processes reading distinct batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_ranks(self) -> int:
        """Ranks that share one data shard (and read the same batches): one CP x TP group."""
        return self.cp * self.tp

    def data_rank(self, global_rank: int) -> int:
        return global_rank // self.model_ranks

    def describe(self) -> str:
        return " x ".join(f"{axis} {size}" for axis, size in zip(AXES, self.sizes) if size > 1) or "one process"


def parse_mesh(value: Optional[Mapping[str, Any]], world_size: int) -> MeshShape:
    """The mesh a config asks for, resolved for `world_size` processes (None: FSDP over every
    process, `{dp_shard: -1}`). One clear sentence for every way it can be wrong."""
    given = dict(value) if value is not None else {"dp_shard": -1}
    unknown = [k for k in given if k not in AXES]
    if unknown:
        raise ConfigError(f"strategy.mesh has unknown axis {', '.join(map(repr, unknown))}; its axes are "
                          f"{', '.join(AXES)}.")
    sizes: dict[str, int] = {}
    for axis in AXES:
        raw = given.get(axis, 1)
        if isinstance(raw, bool) or not isinstance(raw, int) or (raw < 1 and raw != -1):
            raise ConfigError(f"strategy.mesh.{axis} is {raw!r}; give a positive whole number, or -1 for the rest "
                              "of the processes.")
        sizes[axis] = raw
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(f"strategy.mesh sets {' and '.join(free)} to -1; only one axis may take the rest of the "
                          "processes.")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if world_size % fixed:
            raise ConfigError(f"strategy.mesh's fixed axes multiply to {fixed}, which does not divide the world size "
                              f"{world_size}, so {free[0]}: -1 has no whole size; choose axes whose product divides "
                              f"{world_size}.")
        sizes[free[0]] = world_size // fixed
    elif fixed != world_size:
        shown = ", ".join(f"{axis}: {size}" for axis, size in sizes.items() if size > 1) or "all axes 1"
        raise ConfigError(f"strategy.mesh ({shown}) multiplies to {fixed} processes but this run has {world_size}; "
                          "make the product of the axes equal the number of processes (or set one axis to -1).")
    shape = MeshShape(**sizes)
    check_cp(shape)
    return shape


def check_cp(shape: MeshShape) -> None:
    """Context parallelism is not implemented: refuse it with the reason."""
    if shape.cp > 1:
        raise ConfigError(f"strategy.mesh.cp is {shape.cp}, but kiln's model_parallel does not implement context "
                          "parallelism yet (torch's context_parallel needs CUDA and its SDPA kernels, so it cannot run "
                          "on CPU/gloo either); set cp: 1 and use dp_shard or tp for the processes instead.")


def build_device_mesh(shape: MeshShape, device_type: str) -> Any:
    """One DeviceMesh with all four named axes (axes of size 1 included, so `mesh["tp"]` always works
    in a user's `configure_model(mesh)`). A collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=AXES)


def dp_mesh(mesh: Any, shape: MeshShape) -> Any:
    """The sub-mesh FSDP2 shards over: (dp_replicate, dp_shard) as HSDP when both are used, else dp_shard."""
    return mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 else mesh["dp_shard"]
