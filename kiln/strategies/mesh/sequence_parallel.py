"""`strategy.sequence_parallel: true`: the activations between tensor-parallel regions are split by
sequence (Megatron's sequence parallelism, torchtitan's Llama `apply_tp`), so the norms (and any
dropout there) run on 1/tp of the tokens and no TP rank holds the whole residual stream.

Derived from the resolved tp_plan, never written by hand:

    embedding (embedding_rowwise)      output Shard(1): a reduce-scatter instead of an all-reduce
    norms on the residual stream       SequenceParallel(): weights replicated, input/output Shard(1)
    attention / MLP block              its hidden-states input all-gathered to a whole (Replicate) tensor
      colwise layers inside it           unchanged (whole input, output features split)
      rowwise layer ending it            output Shard(1): a reduce-scatter instead of an all-reduce
    head (colwise_gather_output)       input Shard(1) (loss_parallel.py may keep its output split too)

The residual stream stays a DTensor (`use_local_output=False`), not torchtitan's local tensor: a
Transformers model reads the sequence length off the embedding's output to build `position_ids`, the
causal mask and the rotary `position_embeddings`, and a DTensor reports the whole length, so those
stay whole and match the all-gathered input of the attention. A block is a rowwise layer's parent
(`self_attn`, `mlp`); a decoder layer is a block's parent. Anything else with parameters on the
path (a learned position embedding, a layer's own parameter, a module that is not a norm) makes the
layout underivable, and kiln refuses in one sentence rather than guess.

HF's `sequence_parallel` tp_plan style marks one norm; HF's rowwise layers still all-reduce whole
activations, so that style alone shards nothing. kiln has one switch instead, which changes the
whole chain; a tp_plan mapping that names the style is refused (tp_plan.py) with that advice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kiln.utils.errors import ConfigError

#: the styles whose layers end a sequence-sharded region (the head) or start it (the embedding)
HEAD_STYLES = ("colwise_gather_output", "colwise_rep")


@dataclass
class SequenceLayout:
    """Module names (in the user's module) that sequence parallelism changes."""

    embedding: str
    head: str
    blocks: list[str] = field(default_factory=list)  # their hidden-states input is gathered whole
    norms: list[str] = field(default_factory=list)  # SequenceParallel()
    rowwise: list[str] = field(default_factory=list)  # output Shard(1)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _is_norm(module: nn.Module) -> bool:
    """A per-token normalisation (RMSNorm / LayerNorm by class name, as every Transformers model
    names them) with only 1-D weights of its own: it gives the same result on any split of the tokens."""
    kind = type(module).__name__.lower()
    own = list(module.parameters(recurse=False))
    return (
        (kind.endswith("rmsnorm") or kind.endswith("layernorm"))
        and all(p.dim() == 1 for p in own)
        and not any(list(child.parameters()) for child in module.children())
    )


class _Underivable(Exception):
    """Why kiln cannot place the layout (a clause of derive_layout's one ConfigError sentence)."""


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def derive_layout(root: nn.Module, plan: dict[str, str]) -> SequenceLayout:
    """The sequence-parallel layout of `root` under the checked `plan` (module name -> style), or a
    one-sentence ConfigError saying what kiln cannot place."""
    try:
        return _derive(root, plan)
    except _Underivable as why:
        raise ConfigError(
            f"strategy.sequence_parallel cannot derive a sequence-sharded layout for {type(root).__name__}: "
            f"{why}; set sequence_parallel: false (plain tensor parallel), or parallelise the model "
            "yourself in configure_model(mesh)."
        ) from None


def _derive(root: nn.Module, plan: dict[str, str]) -> SequenceLayout:
    by_style: dict[str, list[str]] = {}
    for name, style in plan.items():
        by_style.setdefault(style, []).append(name)
    embeddings, heads = by_style.get("embedding_rowwise", []), [n for s in HEAD_STYLES for n in by_style.get(s, [])]
    if len(embeddings) != 1 or len(heads) != 1:
        raise _Underivable(
            f"tp_plan splits {len(embeddings)} input embedding(s) (embedding_rowwise) and {len(heads)} "
            "output head(s) (colwise_gather_output), and it needs one of each, where the sequence "
            "split starts and ends (tied input/output embeddings stay whole)"
        )
    layout = SequenceLayout(embedding=embeddings[0], head=heads[0], rowwise=sorted(by_style.get("rowwise", [])))
    layout.blocks = sorted({_parent(name) for name in layout.rowwise})
    for name in by_style.get("colwise", []):
        if _parent(name) not in layout.blocks:
            raise _Underivable(
                f"the colwise layer {name} is not beside a rowwise layer, so kiln cannot tell where its "
                "block's whole input comes from"
            )
    if not layout.blocks or "" in layout.blocks:
        raise _Underivable("tp_plan has no block of colwise layers ending in a rowwise layer inside a decoder layer")
    layers = sorted({_parent(block) for block in layout.blocks})
    base = _parent(layout.embedding)  # the base model: embedding, decoder layers, final norm
    if not base or layout.head.startswith(base + "."):
        raise _Underivable(
            f"the embedding {layout.embedding} and the head {layout.head} are not in a base model and "
            "beside it respectively, so kiln cannot tell which output the head reads"
        )
    for layer in layers:
        if not layer.startswith(base + "."):
            raise _Underivable(f"the decoder layer {layer} is not inside {base}, which holds the embedding")
        layout.norms += _norms_beside(root, layer, skip=set(layout.blocks))
    containers = {
        f"{base}.{child}"
        for child, _ in root.get_submodule(base).named_children()
        if any(layer.startswith(f"{base}.{child}.") for layer in layers)
    }
    layout.norms += _norms_beside(root, base, skip=containers | {layout.embedding})
    return layout


def _norms_beside(root: nn.Module, parent: str, skip: set[str]) -> list[str]:
    """The children of `parent` other than `skip` that see the sequence-sharded residual stream: norms
    (returned), parameterless modules (dropout, rotary embeddings: left alone), nothing else."""
    module = root.get_submodule(parent)
    if any(p is not None for p in module._parameters.values()):
        raise _Underivable(
            f"{parent} ({type(module).__name__}) has parameters of its own on the residual "
            "stream, which kiln does not know how to split by sequence"
        )
    norms = []
    for child_name, child in module.named_children():
        name = f"{parent}.{child_name}"
        if name in skip or not _has_params(child):
            continue
        if not _is_norm(child):
            raise _Underivable(
                f"{name} ({type(child).__name__}) sits on the residual stream between tensor-parallel "
                "blocks and is no RMSNorm/LayerNorm, so kiln does not know how it handles a sequence split"
            )
        norms.append(name)
    return norms


def sequence_styles(layout: SequenceLayout, loss_parallel: bool) -> dict[str, Any]:
    """The parallel styles sequence parallelism puts in place of the plain plan's, by module name
    (the colwise layers keep theirs: their block hands them a whole input)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    # use_local_output=False: the residual stream stays a DTensor (see the module docstring)
    styles: dict[str, Any] = {
        layout.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    }
    styles.update({name: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) for name in layout.rowwise})
    styles.update({name: SequenceParallel() for name in layout.norms})
    if not loss_parallel:  # else loss_parallel.head_style takes the head
        styles[layout.head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return styles


def gather_block_inputs(root: nn.Module, layout: SequenceLayout) -> None:
    """Before each block runs, all-gather its sequence-sharded hidden states into a whole local
    tensor (torchtitan's PrepareModuleInput(Shard(1) -> Replicate)). A hook of our own because a
    Transformers decoder layer passes them by keyword to attention (`hidden_states=`) and by position
    to the MLP, and PrepareModuleInput needs to be told which."""
    for name in layout.blocks:
        root.get_submodule(name).register_forward_pre_hook(_gather_hidden_states(name), with_kwargs=True)


def _gather_hidden_states(name: str) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    def whole(x: Any) -> Any:
        # backward: the Replicate gradient (the colwise layers all-reduce theirs) is cut back to this rank's tokens
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], DTensor):
            return (whole(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), DTensor):
            return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
        # a whole plain tensor here means the model left the sharded residual stream somewhere kiln did not see
        raise RuntimeError(
            f"sequence parallel: {name} ({type(module).__name__}) got no sequence-sharded hidden states "
            "(a DTensor as its first argument or hidden_states=); set strategy.sequence_parallel: false "
            "for this model."
        )

    return hook


def replicate_norm_gradients(root: nn.Module, layout: SequenceLayout) -> None:
    """A norm's weight is replicated on tp but each rank sees only its tokens, so its gradient comes
    out of backward `Partial` (a per-rank partial sum). Sum it (all-reduce) as soon as it is
    accumulated, so clipping's global norm and the optimizer see the whole gradient, as torchtitan's
    FSDP does for it (FSDP2 redistributes these itself, on the parameters it swaps in: the hooks on
    the parameters set here then never fire)."""
    for name in layout.norms:
        for p in root.get_submodule(name).parameters():
            p.register_post_accumulate_grad_hook(_sum_partial_gradient)


def _sum_partial_gradient(p: Any) -> None:
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor) and any(placement.is_partial() for placement in g.placements):
        p.grad = g.redistribute(placements=p.placements)
