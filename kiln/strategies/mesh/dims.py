"""The mesh of the sharding strategy (`fsdp`, `model_parallel`): its named axes, read from the config
and checked against the world size before any process group starts, and the rank arithmetic built on
them -- torchtitan's ParallelDims.

Axes, outermost first (torchtitan's ParallelDims and accelerate's ParallelismConfig order):
`dp_replicate` (replicas of the sharded model), `dp_shard` (FSDP2 shards the parameters over it),
`cp` (context parallel: each rank of a cp group gets its own chunk of the same sequences, see
context_parallel.py) and `tp` (tensor parallel, innermost so one TP group is neighbouring ranks, on
one node). Ranks fill the mesh in that row-major order, so the data shard of rank r is
r // (cp * tp): the `cp * tp` ranks of one data shard read the same batches.

`pp` (pipeline stages, kiln/strategies/mesh/pipeline.py) is the outermost axis, ahead of dp_replicate:
rank r holds stage r // (world / pp), and the ranks of one stage are the mesh above. It is left out of
the DeviceMesh's dimensions unless it is used (`mesh_axes`). `ep` (expert parallelism,
kiln/strategies/mesh/expert_parallel.py) sits right after dp_shard when it is used: the experts of each
MoE layer are split over it. Alone (`{ep: N}`, N processes), it is one more data axis for every other
parameter (its ranks read distinct batches, so `dp` counts it, and the rest is replicated). Beside
dp_shard (`{dp_shard: D, ep: N}`, D processes, N dividing D) its ranks are borrowed from dp_shard, as
torchtitan's `dp_shard_in_ep`: FSDP2 shards every other parameter over the D ranks, the experts are
split over ep and FSDP-shards them over the D / N ranks left (`dp_shard_mod_ep`), and the DeviceMesh
writes dp_shard as those two axes (`mesh_axes`), flattened back into `dp_shard` (`flatten_axes`).
Beside tp (`{ep: N, tp: T}`, N x T processes) it is a data axis of its own as alone, each data
shard's T ranks splitting what is not an expert (expert_parallel.py), and counted among the data
axes `flatten_axes` joins. Beside dp_replicate (`{dp_replicate: R, ep: N}`, R x N processes) it is a
data axis of its own too: each of the R replicas holds every expert split over its N ranks, and the
dp_replicate x ep ranks all read distinct batches (HSDP with shards of one rank, as pp beside
dp_replicate). Beside cp or pp, or beside two of dp_replicate, dp_shard and tp at once, it is refused
(`parse_mesh`).

FSDP2 shards over `dp_shard` and `cp` flattened into one axis (torchtitan's `dp_shard_cp`): the cp
ranks compute gradients from different tokens, so those gradients must be reduced over them too,
and sharding over them costs nothing more (FSDP gathers each unit over that axis either way).

`model_parallel` writes it as `mesh: {dp_replicate: 1, dp_shard: 2, tp: 2}` (missing axes are 1 and
one axis may be -1, the rest of the world); HF's `parallelism_config` (accelerate's ParallelismConfig,
or a mapping with its `*_size` keys) becomes the same mapping (kiln.config.hf.rewrites.parallelism_config);
`fsdp` derives it from its sharding option (kiln/strategies/fsdp/strategy.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.utils.errors import ConfigError

#: the axes of the DeviceMesh, outermost first (its dimension names)
AXES = ("dp_replicate", "dp_shard", "cp", "tp")
#: the pipeline axis, outermost (a DeviceMesh dimension only when it is larger than 1)
PP = "pp"
#: the expert axis (a DeviceMesh dimension, after dp_shard, only when it is larger than 1)
EP = "ep"
#: under ep within dp_shard, the dp_shard ranks of one expert shard: FSDP shards the experts over it
DP_SHARD_MOD_EP = "dp_shard_mod_ep"
#: the axes ep runs beside, one at a time (parse_mesh refuses two of them, and cp or pp, with ep)
EP_JOINS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The resolved sizes of the axes (pp times the product of AXES is the world size, times ep unless
    it is borrowed from dp_shard: `ep_in_dp_shard`)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def ep_in_dp_shard(self) -> bool:
        """Whether ep's ranks are dp_shard's (torchtitan's `dp_shard_in_ep`) rather than ranks of their own."""
        return self.ep > 1 and self.dp_shard > 1

    @property
    def own_ep(self) -> int:
        """The ranks ep adds to the world: ep alone, 1 when borrowed from dp_shard."""
        return 1 if self.ep_in_dp_shard else self.ep

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of processes reading distinct batches (the ep ranks do)."""
        return self.dp_replicate * self.dp_shard * self.own_ep

    @property
    def dp_cp(self) -> int:
        """Ranks whose micro-batches hold distinct tokens (data shards x cp chunks): what token counts
        are summed over and what FSDP2's gradient reduction divides by."""
        return self.dp * self.cp

    @property
    def model_ranks(self) -> int:
        """Ranks that share one data shard (and read the same batches): one CP x TP group."""
        return self.cp * self.tp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (the whole world without pp)."""
        return math.prod(self.sizes) * self.own_ep

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards over the dp axes: when they (with cp) hold more than one rank, and also
        on one rank when no tp axis splits the model either, so that a one-process run is still an
        FSDP run (its CPU offload, its mixed-precision policy), as `strategy: fsdp` always was. Not
        under pp or ep alone: the pipeline shards its stages itself, with dp_shard or dp_replicate (pipeline.py), and ep with ranks of
        its own (alone, beside tp or dp_replicate) replicates what is not an expert, or splits it over tp
        (expert_parallel.py); ep within dp_shard is FSDP."""
        return (self.dp_cp > 1 or self.tp == 1) and self.pp == 1 and self.own_ep == 1

    def data_rank(self, global_rank: int) -> int:
        """The data shard of `global_rank`: every pipeline stage reads the same batches."""
        return (global_rank % self.stage_ranks) // self.model_ranks

    def stage(self, global_rank: int) -> int:
        """The pipeline stage `global_rank` holds (0 without pp)."""
        return global_rank // self.stage_ranks

    def mesh_axes(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The DeviceMesh's dimension names and sizes: pp ahead of AXES and ep after dp_shard, each
        when it is used; ep within dp_shard splits dp_shard into (dp_shard_mod_ep, ep), ep innermost
        (rank r of dp_shard holds ep rank r % ep), as torchtitan."""
        names, sizes = list(AXES), list(self.sizes)
        if self.ep_in_dp_shard:
            at = AXES.index("dp_shard")
            names[at : at + 1] = [DP_SHARD_MOD_EP, EP]
            sizes[at : at + 1] = [self.dp_shard // self.ep, self.ep]
        elif self.ep > 1:
            at = AXES.index("dp_shard") + 1
            names.insert(at, EP)
            sizes.insert(at, self.ep)
        if self.pp > 1:
            names.insert(0, PP)
            sizes.insert(0, self.pp)
        return tuple(names), tuple(sizes)

    def describe(self) -> str:
        if self.ep_in_dp_shard:
            given = zip((*AXES, EP), (*self.sizes, self.ep))
            return " x ".join(f"{a} {n}" for a, n in given if n > 1).replace(" x ep", " with ep")
        names, sizes = self.mesh_axes()
        return " x ".join(f"{axis} {size}" for axis, size in zip(names, sizes) if size > 1) or "one process"


def parse_mesh(value: Mapping[str, Any] | None, world_size: int) -> ParallelDims:
    """The mesh a config asks for, resolved for `world_size` processes (None: FSDP over every
    process, `{dp_shard: -1}`). One clear sentence for every way it can be wrong."""
    given = dict(value) if value is not None else {"dp_shard": -1}
    every = (PP, *AXES, EP)
    unknown = [k for k in given if k not in every]
    if unknown:
        raise ConfigError(
            f"strategy.mesh has unknown axis {', '.join(map(repr, unknown))}; its axes are {', '.join(every)}."
        )
    sizes: dict[str, int] = {}
    for axis in every:
        raw = given.get(axis, 1)
        if isinstance(raw, bool) or not isinstance(raw, int) or (raw < 1 and raw != -1):
            raise ConfigError(
                f"strategy.mesh.{axis} is {raw!r}; give a positive whole number, or -1 for the rest of the processes."
            )
        sizes[axis] = raw
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(
            f"strategy.mesh sets {' and '.join(free)} to -1; only one axis may take the rest of the processes."
        )
    borrowed = sizes[EP] != 1 and sizes["dp_shard"] != 1  # ep within dp_shard: no ranks of its own
    if borrowed and sizes[EP] == -1:
        raise ConfigError(
            "strategy.mesh.ep is -1 beside dp_shard, whose ranks ep borrows; give ep a size that divides dp_shard."
        )
    fixed = math.prod(size for axis, size in sizes.items() if size != -1 and not (borrowed and axis == EP))
    if free:
        if world_size % fixed:
            raise ConfigError(
                f"strategy.mesh's fixed axes multiply to {fixed}, which does not divide the world size "
                f"{world_size}, so {free[0]}: -1 has no whole size; choose axes whose product divides "
                f"{world_size}."
            )
        sizes[free[0]] = world_size // fixed
    elif fixed != world_size:
        shown = ", ".join(f"{axis}: {size}" for axis, size in sizes.items() if size > 1) or "all axes 1"
        raise ConfigError(
            f"strategy.mesh ({shown}) multiplies to {fixed} processes"
            f"{' (ep borrows the ranks of dp_shard)' if borrowed else ''} but this run has {world_size}; "
            "make the product of the axes equal the number of processes (or set one axis to -1)."
        )
    others = [f"{axis} {size}" for axis in (PP, "cp") if (size := sizes[axis]) > 1]
    joined = [f"{axis} {size}" for axis in EP_JOINS if (size := sizes[axis]) > 1]
    if sizes[EP] > 1 and (others or len(joined) > 1):
        raise ConfigError(
            f"strategy.mesh combines ep {sizes[EP]} with {' and '.join(others or joined)}, but kiln runs the "
            "expert axis alone, within dp_shard, beside tp or beside dp_replicate so far (not with cp or pp, nor "
            "with two of dp_replicate, dp_shard and tp at once); set the other axes to 1, or drop ep."
        )
    if borrowed and sizes["dp_shard"] % sizes[EP]:
        raise ConfigError(
            f"strategy.mesh.ep {sizes[EP]} borrows its ranks from dp_shard {sizes['dp_shard']}, which it does not "
            f"divide; choose an ep that divides {sizes['dp_shard']}."
        )
    return ParallelDims(**sizes)


def build_device_mesh(shape: ParallelDims, device_type: str) -> Any:
    """One DeviceMesh with all four named axes (axes of size 1 included, so `mesh["tp"]` always works
    in a user's `configure_model(mesh)`), and `pp` and `ep` among them when they are used. A collective: every
    rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = shape.mesh_axes()
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def dp_mesh(mesh: Any, shape: ParallelDims) -> Any:
    """The sub-mesh FSDP2 shards over: (dp_replicate, dp_shard) as HSDP when both are used, else dp_shard;
    with cp, dp_shard and cp flattened into `dp_shard_cp` take dp_shard's place (as in torchtitan), so
    the gradients of the cp ranks' different tokens are reduced together (`flatten_axes` made it)."""
    shard = "dp_shard_cp" if shape.cp > 1 else "dp_shard"
    return mesh["dp_replicate", shard] if shape.dp_replicate > 1 else mesh[shard]


def flatten_axes(mesh: Any, shape: ParallelDims) -> Any:
    """Flatten the joint axes the strategy needs, once, right after the mesh is built: `dp_shard_cp`
    (FSDP's shard axis under cp) and, with tp, the group of ranks at one TP position whose data differ
    (`dp_replicate x dp_shard x cp`, for `reduce`; None without tp: then that is every rank). A
    collective (flattening makes the new axes' process groups): every rank calls it. Under ep within
    dp_shard, `dp_shard` itself is the flattened (dp_shard_mod_ep, ep)."""
    if shape.ep_in_dp_shard:
        mesh[DP_SHARD_MOD_EP, EP]._flatten("dp_shard")
    if shape.cp > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # registers the axis on the root mesh
    if shape.tp > 1 and shape.dp_cp > 1:  # ep with ranks of its own is a data axis too
        data = ("dp_replicate", "dp_shard", *((EP,) if shape.own_ep > 1 else ()), "cp")
        return mesh[data]._flatten("dp_cp").get_group()
    return None


def release_mesh_groups(mesh: Any) -> None:
    """Drop a DeviceMesh's hold on its process groups at teardown (see destroy_default_group): it keeps
    them in a registry of its own (torch >= 2.9), and the module's DTensors keep the mesh."""
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
