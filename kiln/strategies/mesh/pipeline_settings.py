"""`strategy.pipeline` of `model_parallel` with a `pp` axis, read once, and what a pipeline run cannot
do yet, refused at config load in one sentence each (pipeline.py runs it):

    strategy: {name: model_parallel, mesh: {pp: 2}, pipeline: {schedule: 1f1b, microbatches: 4, split: auto}}

- `schedule`: gpipe (every forward of the window, then every backward), 1f1b (one forward, one
  backward in the steady state: at most pp micro-batches' activations alive; the default), or one of
  torch's schedules with several stages per rank: interleaved_1f1b (Megatron's interleaving: rank r
  holds stages r, r + pp, ...), interleaved_zb (the same layout, the zero-bubble ZB1P order, which
  splits each backward into its input and weight halves to fill the bubble) and zbv (zero bubble in a
  V: exactly 2 stages per rank, rank r holding stages r and 2 pp - 1 - r).
- `stages_per_rank`: how many stages each rank holds: 1 for gpipe and 1f1b, 2 (the default) or more
  for the interleaved schedules, exactly 2 for zbv.
- `microbatches`: the pipeline's micro-batches are the accumulation window's, so when given it must
  equal `gradient_accumulation_steps` (a reminder the config can carry, not a second knob).
- `split`: auto (contiguous runs of decoder layers, balanced by parameters, then by count) or the
  index of the first layer of each stage after the first (`[2]`: layers 0-1 on stage 0, the rest on 1);
  there are pp x stages_per_rank stages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kiln.strategies.mesh.axis_refusals import refuse, unsupported_settings
from kiln.strategies.mesh.dims import AXES, ParallelDims
from kiln.strategies.mesh.settings import MeshSettings
from kiln.utils.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
#: the schedules that run several stages on each rank (torch's PipelineScheduleMulti)
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv")
_KEYS = ("schedule", "microbatches", "stages_per_rank", "split")


@dataclass(frozen=True)
class PipelineSettings:
    schedule: str = "1f1b"
    microbatches: int | None = None
    #: the first layer of each stage after the first; None: auto
    split: tuple[int, ...] | None = None
    stages_per_rank: int = 1

    def stages(self, pp: int) -> int:
        return pp * self.stages_per_rank

    @property
    def style(self) -> str:
        """How stages map to ranks, in torch's words: "loop" (stage s on rank s % pp) or "v" (zbv)."""
        return "v" if self.schedule == "zbv" else "loop"


def read_pipeline(value: Any) -> PipelineSettings:
    """`strategy.pipeline` (None: the defaults), one sentence for each way it can be wrong."""
    given = dict(value) if isinstance(value, Mapping) else {} if value is None else None
    if given is None:
        raise ConfigError(f"strategy.pipeline is {value!r}; give a mapping such as {{schedule: 1f1b, split: auto}}.")
    unknown = [k for k in given if k not in _KEYS]
    if unknown:
        raise ConfigError(
            f"strategy.pipeline has unknown key(s) {', '.join(map(repr, unknown))}; its keys are {', '.join(_KEYS)}."
        )
    schedule = str(given.get("schedule", "1f1b")).lower()
    if schedule not in SCHEDULES:
        raise ConfigError(f"strategy.pipeline.schedule is {given['schedule']!r}; choose one of {', '.join(SCHEDULES)}.")
    micro = given.get("microbatches")
    if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
        raise ConfigError(f"strategy.pipeline.microbatches is {micro!r}; give a positive whole number.")
    multi = schedule in MULTI_STAGE
    per_rank = given.get("stages_per_rank", 2 if multi else 1)
    if schedule == "zbv":
        runs, fix = "exactly 2 stages", "drop it"
    elif multi:
        runs, fix = "2 or more stages", "give 2 or more"
    else:
        runs, fix = "one stage", "drop it, or choose interleaved_1f1b, interleaved_zb or zbv to run several"
    count = None if isinstance(per_rank, bool) or not isinstance(per_rank, int) else per_rank
    if count is None or (count != 2 if schedule == "zbv" else count < 2 if multi else count != 1):
        raise ConfigError(
            f"strategy.pipeline.stages_per_rank is {per_rank!r}, but schedule {schedule} runs {runs} on each "
            f"rank; {fix}."
        )
    split = given.get("split", "auto")
    if split == "auto" or split is None:
        cuts = None
    elif isinstance(split, Iterable) and not isinstance(split, str):  # a list, or OmegaConf's ListConfig
        cuts = tuple(split)
    else:
        raise ConfigError(
            f"strategy.pipeline.split is {split!r}; give auto or a list of layer indices (where each stage "
            "after the first begins)."
        )
    return PipelineSettings(schedule, micro, cuts, per_rank)


def check_pipeline(p: PipelineSettings, dims: ParallelDims, s: MeshSettings, config: Any, precision: str) -> None:
    """What the pipeline cannot run, refused before any process group starts: beside pp, one of
    dp_shard (each stage sharded by FSDP2 over its dp_shard ranks), dp_replicate (each stage replicated,
    its gradients all-reduced: FSDP2's HSDP with shards of one rank) or tp (each stage split by
    kiln's tensor-parallel plan over its tp ranks), pipeline.py."""
    beside = [f"{axis} {getattr(dims, axis)}" for axis in AXES if getattr(dims, axis) > 1]
    if dims.cp > 1 or len(beside) > 1:
        raise ConfigError(
            f"strategy.mesh combines pp {dims.pp} with {' and '.join(beside)}, but kiln runs the pipeline axis "
            "alone or with one of dp_shard, dp_replicate or tp beside it so far (not with cp, nor with two of them "
            "together); set all but one of those axes to 1, or drop pp."
        )
    settings = unsupported_settings(s, config)
    settings["sequence_parallel"] = s.sequence_parallel
    settings["loss_parallel"] = s.loss_parallel
    if config is not None:
        train = config.train
        settings["train.label_smoothing_factor"] = bool(train.label_smoothing_factor)
        settings["train.neftune_noise_alpha"] = bool(train.neftune_noise_alpha)
        settings["eval.compile"] = bool(config.eval.compile)
        settings["eval.predict_with_generate (generation runs the whole model)"] = bool(
            config.eval.predict_with_generate
        )
    if precision in ("fp16", "fp16-true"):
        settings[f"precision {precision} (its loss scale is not carried through the schedule; bf16 is)"] = True
    refuse("pp", dims.pp, settings)
    if config is None:
        return
    window = int(config.train.gradient_accumulation_steps)
    if p.microbatches is not None and p.microbatches != window:
        raise ConfigError(
            f"strategy.pipeline.microbatches is {p.microbatches}, but the pipeline's micro-batches are the "
            f"accumulation window's ({window}); set train.gradient_accumulation_steps to {p.microbatches}."
        )
    rounds = max(1, window // dims.pp)
    if p.schedule in ("interleaved_1f1b", "interleaved_zb") and window % rounds:
        raise ConfigError(
            f"schedule {p.schedule} runs windows of micro-batches in rounds of pp, and the accumulation window "
            f"has {window} for pp {dims.pp}, not a whole number of rounds; set train.gradient_accumulation_steps "
            f"to a multiple of {dims.pp}."
        )
    if p.schedule == "1f1b" and window < dims.pp:
        raise ConfigError(
            f"schedule 1f1b needs at least as many micro-batches as stages, and the accumulation window has "
            f"{window} for pp {dims.pp}; set train.gradient_accumulation_steps to {dims.pp} or more, or "
            "schedule: gpipe."
        )
