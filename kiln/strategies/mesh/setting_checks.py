"""What the mesh strategy's settings cannot do on a given mesh, refused in one sentence each before any process
group starts, the same sentence under both presets (`fsdp`, `model_parallel`): each feature works under both or is
refused under both. What the newest axes (pp, ep) leave out is axis_refusals.py."""

from __future__ import annotations

from typing import Any

from kiln.strategies.mesh.dims import ParallelDims
from kiln.strategies.mesh.settings import MeshSettings
from kiln.utils.errors import ConfigError


def check_settings(s: MeshSettings, dims: ParallelDims, device_type: str, precision: str, config: Any) -> None:
    """The settings `s` on the mesh `dims`, run on a `device_type` device with the `precision` plugin."""
    if s.offload and s.offload_pin_memory and device_type == "cpu":
        raise ConfigError(
            "FSDP offload with pinned memory needs an accelerator, but this run is on the CPU; "
            "set strategy.offload_pin_memory: false (or run on a GPU)."
        )
    if s.offload and not dims.fsdp:
        raise ConfigError(
            f"strategy.offload moves FSDP's shards to the CPU, and this mesh ({dims.describe()}) is "
            "tensor parallel alone, with no FSDP to offload; give the mesh a data-parallel axis "
            "(dp_shard) or drop offload."
        )
    for key in ("sequence_parallel", "loss_parallel"):
        if getattr(s, key) and dims.tp == 1:
            raise ConfigError(
                f"strategy.{key} splits the activations of tensor parallelism, and this mesh has no "
                f"tp axis ({dims.describe()}); set mesh.tp (fsdp: strategy.tp) to 2 or more, or drop "
                f"{key}."
            )
    if s.cpu_ram_efficient_loading and dims.tp > 1:
        raise ConfigError(
            "strategy.cpu_ram_efficient_loading builds the model on rank 0 alone, which tensor "
            f"parallelism cannot split from (this mesh: {dims.describe()}); drop it, or the tp axis."
        )
    if precision == "fp8" and dims.cp * dims.pp * dims.ep > 1:
        raise ConfigError(
            f"precision fp8 runs on the data and tp axes only, and this mesh ({dims.describe()}) splits the "
            "model over context, pipeline or expert axes too (float8 with those is not wired in yet); keep the "
            "mesh to dp_shard / dp_replicate / tp, or use precision: bf16."
        )
    if config is not None and config.train.loss.chunked and dims.tp > 1:
        raise ConfigError(
            "train.loss.chunked multiplies the hidden states by the whole LM head chunk by chunk, and tensor "
            f"parallelism splits that head over this mesh's tp axis ({dims.describe()}); drop train.loss.chunked "
            "(strategy.loss_parallel keeps the logits split over tp instead) or the tp axis."
        )


def check_cp(train: Any) -> None:
    """The `train` settings context parallelism (cp > 1) has not been made to work with."""
    if train.label_smoothing_factor:
        raise ConfigError(
            "label_smoothing_factor with strategy.mesh.cp > 1 is not supported: kiln's label smoother "
            "shifts each rank's chunk of labels itself and would drop every chunk boundary's target."
        )
    if train.neftune_noise_alpha:
        raise ConfigError(
            "neftune_noise_alpha with strategy.mesh.cp > 1 is not supported: NEFTune scales its noise "
            "by the sequence length, which each cp rank sees as its chunk's."
        )
