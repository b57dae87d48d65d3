"""`kiln estimate CONFIG [--nproc N] [--device-memory GiB] [--json] [key=value ...]`: per-rank memory of
the config's model for each strategy and mesh `nproc` processes can run, before anything is launched
(docs/launching.md#will-it-fit-kiln-estimate). The model is built on fake tensors (no weights, no download); the activations come
from one traced forward and backward of the config's first micro-batch (trace.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kiln.estimate.layouts import Setting, layouts, tp_sizes
from kiln.estimate.report import as_json, rows, table
from kiln.estimate.states import Counts
from kiln.estimate.trace import Activations, fake_tp_mesh, trace

#: strategy names (by prefix; xla_fsdp before xla) -> the table's rows the configured strategy is
FAMILIES = (
    ("auto", "auto"),  # one device, or DDP under a launcher (main())
    ("single", "single"),
    ("cpu", "single"),
    ("cuda", "single"),
    ("mps", "single"),
    ("xla_fsdp", "fsdp"),
    ("xla", "ddp"),
    ("ddp", "ddp"),
    ("fsdp", "fsdp"),
    ("model_parallel", "model_parallel"),
    ("deepspeed", "deepspeed"),
)
AC_MODES = ("none", "full", "selective")


def _batch(data: dict[str, Any], size: int) -> Any:
    """The config's first micro-batch: `size` samples of the train (else eval) dataset, collated as the fit
    collates them (its data_collator, else torch's default)."""
    from torch.utils.data import default_collate

    from kiln.task_import import TaskError

    dataset = data.get("train_dataset", data.get("eval_dataset"))
    if dataset is None:
        raise TaskError("task.data returned no train_dataset or eval_dataset for kiln estimate to take a batch from.")
    samples = [dataset[i] for i in range(min(size, len(dataset)))]
    collate = data.get("data_collator") or default_collate
    return collate(samples)


def _forward_keys(model: Any, batch: Any) -> Any:
    """A Transformers-style model gets only the columns its forward takes (HF's remove_unused_columns)."""
    import inspect
    from collections.abc import Mapping

    from kiln.engine.model.module import TrainingModule

    if isinstance(model, TrainingModule) or not isinstance(batch, Mapping):
        return batch
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return batch
    return {k: v for k, v in batch.items() if k in params}


def counts_of(model: Any, blocks: list[Any]) -> tuple[Counts, int]:
    """The parameters' shapes (tied ones once), the largest layer's parameters (ZeRO-3's rule: a module's
    own parameters) and the largest unit FSDP gathers (a block, or what the root holds outside them)."""
    seen: dict[int, Any] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    shapes = tuple((tuple(p.shape), bool(p.requires_grad)) for p in seen.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    root = sum(p.numel() for i, p in seen.items() if i not in in_blocks)
    return Counts(shapes, largest), max([root, *block_sizes])


def _check_nproc(cfg: Any, nproc: int) -> None:
    """One sentence when the config's own mesh cannot be laid on `nproc` processes."""
    from kiln.utils.errors import ConfigError

    if nproc < 1:
        raise ConfigError(f"--nproc is {nproc}; give the number of processes, 1 or more.")
    options = dict(cfg.strategy.options or {})
    if cfg.strategy.name == "model_parallel" and options.get("mesh") is not None:
        from kiln.strategies.mesh.dims import parse_mesh

        parse_mesh(options["mesh"], nproc)  # its own sentence for a mesh that does not fit
    for key in ("tp", "shard_size"):
        size = options.get(key)
        if size is not None and nproc % int(size):
            raise ConfigError(
                f"strategy.options.{key} is {size}, which does not divide --nproc {nproc}; pass a multiple of it."
            )


def estimate(cfg: Any, nproc: int, device_memory: float | None) -> tuple[list[Any], dict[str, Any]]:
    """The rows of the table (report.Row) and what they were computed for."""
    from omegaconf import OmegaConf

    from kiln.strategies.activation_checkpointing import Policy, checkpoint_model, find_blocks, policy
    from kiln.task_import import TaskError, check_kwargs, import_callable
    from kiln.utils.errors import KilnError

    name = str(cfg.strategy.name)  # a registered name (the config loader refuses others); a plugin's marks no row
    family = next((row for prefix, row in FAMILIES if name.startswith(prefix)), None)
    if family == "auto":
        family = "single" if nproc == 1 else "ddp"
    _check_nproc(cfg, nproc)
    if not cfg.task.model or not cfg.task.data:
        raise TaskError("the config must name task.model and task.data ('package.module:callable') to estimate.")
    model_fn = import_callable(cfg.task.model, "task.model")
    data_fn = import_callable(cfg.task.data, "task.data")
    model_args = dict(OmegaConf.to_container(cfg.task.model_args))  # type: ignore[arg-type]
    data_args = dict(OmegaConf.to_container(cfg.task.data_args))  # type: ignore[arg-type]
    check_kwargs(data_fn, data_args, "task.data_args", cfg.task.data)
    data = data_fn(**data_args)
    kwargs = {**model_args, **data.get("model_args", {})}
    check_kwargs(model_fn, kwargs, "task.model_args", cfg.task.model)
    options = dict(cfg.strategy.options or {})
    wrap = options.get("wrap")
    configured = policy(cfg)
    precision = str(cfg.precision.name)
    batch = _batch(data, int(cfg.data.per_device_train_batch_size))
    found: dict[str, Any] = {}

    def build() -> Any:
        return model_fn(**kwargs)

    def prepared(mode: str, mesh: Any = None) -> Any:
        def prepare(model: Any) -> tuple[Any, contextlib.AbstractContextManager[Any]]:
            around: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if mesh is not None:  # split as the mesh strategy splits it: the plan first, then checkpointing
                around = _split(model, mesh, options)
            else:
                found["model"] = model
            found["blocks"] = find_blocks(model, list(wrap) if wrap else None)
            if mode != "none":
                checkpoint_model(model, Policy(mode, configured.every if configured else 1), found["blocks"])
            return _forward_keys(model, batch), around

        return prepare

    chosen = configured.mode if configured else "none"
    try:
        traced: dict[str, Activations | None] = {chosen: trace(build, precision, prepared(chosen))}
    except RuntimeError as err:  # an operation fake tensors cannot run (a data-dependent shape, a custom kernel)
        raise KilnError(
            f"kiln estimate could not trace {cfg.task.model}'s forward and backward on fake tensors "
            f"(activation checkpointing {chosen}): {str(err).splitlines()[0]}"
        ) from err
    counts, unit = counts_of(found["model"], found["blocks"])
    if found["blocks"]:  # the other modes, for the activation-checkpointing line
        for mode in AC_MODES:
            if mode not in traced:
                try:
                    traced[mode] = trace(build, precision, prepared(mode))
                except RuntimeError:  # e.g. selective checkpointing of some attention kernels: shown as n/a
                    traced[mode] = None
    setting = Setting(
        precision, str(cfg.optim.name), cfg.optim.optim_args, unit, _zero(cfg, name, family, nproc, found["model"])
    )
    used = traced[chosen]
    assert used is not None  # traced above, or raised
    split, refused = _split_traces(nproc, lambda mesh: trace(build, precision, prepared(chosen, mesh)))
    shown = [layout for layout in layouts(counts, nproc, setting) if layout.tp not in refused]
    result = rows(shown, used, device_memory, split)
    about = {
        "model": str(cfg.task.model),
        "parameters": counts.total,
        "trainable": counts.trainable,
        "precision": precision,
        "optimizer": str(cfg.optim.name),
        "micro_batch_size": int(cfg.data.per_device_train_batch_size),
        "nproc": nproc,
        "device_memory_gib": device_memory,
        "configured_strategy": family,
        "activation_checkpointing": chosen,
        "activations_by_checkpointing": {mode: t.peak if t else None for mode, t in traced.items()},
        "tensor_parallel_refused": {str(tp): why for tp, why in refused.items()},
    }
    return result, about


def _split(model: Any, mesh: Any, options: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """The config's tp plan (`auto`, the model's own, unless the strategy names one) applied over `mesh`, and
    the context a micro-batch's forward and backward run in: torch's `loss_parallel()` where the head keeps
    its logits split by vocabulary (the strategy's `micro_batch_context` enters the same one), so the loss
    and its gradient are traced on one rank's split of the logits; none otherwise."""
    from kiln.strategies.mesh.tp_plan import apply_tp

    done = apply_tp(
        model,
        mesh["tp"],
        options.get("tp_plan"),
        mesh.size(),
        sequence_parallel=bool(options.get("sequence_parallel", False)),
        loss_parallel=bool(options.get("loss_parallel", False)),
    )
    return done.loss_parallel.context() if done.loss_parallel is not None else contextlib.nullcontext()


def _split_traces(nproc: int, traced_on: Callable[[Any], Activations]) -> tuple[dict[int, Activations], dict[int, str]]:
    """For each tp degree of the model_parallel rows, one rank's activations with the model split that many
    ways over a fake process group (trace.fake_tp_mesh): the head's gathered logits and every layer the plan
    leaves whole count whole, not as 1/tp of the unsplit model's. Also the degrees the model cannot be split
    by (its plan refuses: no plan, heads that tp does not divide), each with the sentence why; their rows are
    left out. Where a process group exists already, or the split cannot run on fake tensors, a degree's row
    keeps the share 1/tp of the unsplit trace."""
    import torch.distributed as dist

    from kiln.utils.errors import ConfigError

    split: dict[int, Activations] = {}
    refused: dict[int, str] = {}
    if dist.is_available() and dist.is_initialized():
        return split, refused
    for tp in tp_sizes(nproc):
        try:
            with fake_tp_mesh(tp) as mesh:
                split[tp] = traced_on(mesh)
        except ConfigError as err:
            refused[tp] = str(err)
        except RuntimeError:  # an operation a DTensor on fake tensors cannot run: the share of the unsplit trace
            continue
    return split, refused


def _zero(cfg: Any, name: str, family: str | None, nproc: int, model: Any) -> dict[str, Any]:
    """The configured DeepSpeed run's zero_optimization section as the run completes it (HF's "auto" bucket
    sizes from the model's hidden size); empty for another strategy (DeepSpeed's defaults)."""
    if family != "deepspeed":
        return {}
    from kiln.config.hf.deepspeed import fill_bucket_sizes, process, read_user_config

    user = read_user_config(dict(cfg.strategy.options or {}).get("config"))
    zero: dict[str, Any] = process(cfg, user, world_size=nproc, precision=str(cfg.precision.name), name=name)[
        "zero_optimization"
    ]
    fill_bucket_sizes(zero, model)
    return zero


def _header(about: dict[str, Any]) -> list[str]:
    from kiln.estimate.report import _size

    modes = ", ".join(
        f"{mode} {_size(b) if b is not None else 'n/a'}" for mode, b in about["activations_by_checkpointing"].items()
    )
    memory = (
        f"{about['device_memory_gib']} GiB" if about["device_memory_gib"] is not None else "not given (--device-memory)"
    )
    return [
        f"kiln estimate: {about['model']}: {about['parameters']:,} parameters ({about['trainable']:,} trainable), "
        f"{about['precision']}, {about['optimizer']}, micro-batch {about['micro_batch_size']}, {about['nproc']} "
        f"process{'es' if about['nproc'] != 1 else ''}, device memory {memory}",
        f"activations per micro-batch by activation checkpointing: {modes} (the table uses {about['activation_checkpointing']})",
        *(f"model_parallel tp={tp} left out: {why}" for tp, why in about["tensor_parallel_refused"].items()),
        "(* the config's strategy; peak/rank: the largest of backward and the optimizer step)",
    ]


def main(argv: Sequence[str]) -> int:
    from kiln.config import ConfigError
    from kiln.launch.settings import load_with_launcher_settings
    from kiln.task_import import TaskError
    from kiln.utils.errors import KilnError

    parser = argparse.ArgumentParser(prog="kiln estimate", add_help=True)
    parser.add_argument("config")
    parser.add_argument("--nproc", type=int, default=1, help="processes the run would start (default 1)")
    parser.add_argument("--device-memory", dest="device_memory", type=float, default=None, help="GiB per device")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ns, overrides = parser.parse_known_args(list(argv))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        print(
            f"kiln estimate: error: unrecognised argument {bad[0]!r}; overrides look like key=value.", file=sys.stderr
        )
        return 2
    try:
        cfg = load_with_launcher_settings(ns.config, overrides)
        result, about = estimate(cfg, ns.nproc, ns.device_memory)
    except (ConfigError, KilnError, TaskError) as err:
        print(f"kiln estimate: error: {err}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(as_json(result, about), indent=2))
    else:
        print(table(result, _header(about), about["configured_strategy"]))
    return 0
