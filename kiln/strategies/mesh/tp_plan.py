"""`strategy.tp_plan`: which layers tensor parallelism splits, and how, turned into one
`parallelize_module` call over the mesh's `tp` axis.

`auto` (the default) is the Transformers model's own plan: `model.tp_plan` (the class's plan, e.g.
Llama's `lm_head: colwise_gather_output`, plus `config.base_model_tp_plan` under the base model's
prefix), found on the first Transformers model inside the user's module; a model without one (GPT-2,
whose Conv1D layers no style can split) is refused with a sentence naming the families that have one.
A mapping gives module-name
patterns (relative to the user's module; `*` is one name component, as in `layers.*.mlp.up_proj`)
and a style each:

    colwise                  Linear: output features split; output stays split (the next rowwise joins it)
    rowwise                  Linear: input features split; the outputs are summed into a whole tensor
    colwise_gather_output    Linear: colwise, output gathered whole (HF's name; `colwise_rep` too)
    embedding_rowwise        Embedding: the vocabulary split, the looked-up vectors summed whole
    replicate                left whole on every TP rank (FSDP still shards it over the dp axes)

HF's `sequence_parallel` style is refused with a sentence pointing to `strategy.sequence_parallel:
true`, which derives the sequence-sharded layout from the whole plan (sequence_parallel.py);
`strategy.loss_parallel: true` keeps the head's logits split by vocabulary (loss_parallel.py).

Checked before anything is split, one sentence each: a pattern of a given plan that matches no
module (`auto` skips the optional layers a configuration lacks), a style
that is unknown or does not fit the layer, a TP size that does not divide the model's attention
heads or key/value heads, or a split dimension. A layer whose weight is tied to a layer outside it
(tied input/output embeddings) is left replicated, and a log line says so: splitting one side of a
tie would untie it."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from kiln.utils.errors import ConfigError

log = logging.getLogger(__name__)

#: style -> the dimension it splits: Linear "out" / "in" features, Embedding "vocab" rows (None: nothing)
STYLES = {
    "colwise": "out",
    "rowwise": "in",
    "colwise_gather_output": "out",
    "colwise_rep": "out",
    "embedding_rowwise": "vocab",
    "replicate": None,
}
#: HF styles kiln does not take in a mapping -> what to do instead
_REFUSED = {
    "sequence_parallel": "kiln derives sequence parallelism from the whole plan, so set "
    "strategy.sequence_parallel: true and leave the norms out of tp_plan"
}

_WHAT: dict[str | None, str] = {"out": "output features", "in": "input features", "vocab": "vocabulary rows"}

PlanOption = None | str | Mapping[str, str]

#: model families (as the refusal names them -> transformers' model_type) whose config defines the
#: tensor-parallel plan `tp_plan: auto` takes; a test checks each against the installed transformers
TP_FAMILIES = {
    "Llama": "llama",
    "Mistral": "mistral",
    "Mixtral": "mixtral",
    "Qwen2": "qwen2",
    "Qwen3": "qwen3",
    "Gemma": "gemma",
    "Phi-3": "phi3",
    "OLMo": "olmo",
    "GPT-NeoX": "gpt_neox",
    "Granite": "granite",
}


def user_module(module: nn.Module) -> nn.Module:
    """The user's module inside kiln's step dispatcher (a parameterless wrapper whose one child is
    `module`), or `module` itself."""
    children = list(module.named_children())
    if len(children) == 1 and children[0][0] == "module" and not module._parameters:
        return children[0][1]
    return module


def hf_model(root: nn.Module) -> tuple[str, nn.Module | None]:
    """The outermost Transformers model in `root` (one with a `tp_plan` or a config's
    `base_model_tp_plan`) and its name in `root`."""
    for name, sub in root.named_modules():
        config = getattr(sub, "config", None)
        if isinstance(getattr(sub, "tp_plan", None), Mapping) or getattr(config, "base_model_tp_plan", None):
            return name, sub
    return "", None


def _auto_plan(root: nn.Module) -> dict[str, str]:
    prefix, model = hf_model(root)
    if model is None:
        raise ConfigError(
            f"strategy.tp_plan is auto but {type(root).__name__} holds no Transformers model with a "
            "tensor-parallel plan (config.base_model_tp_plan); give strategy.tp_plan as a mapping of "
            "module-name patterns to colwise / rowwise."
        )
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        config: Any = model.config  # a Transformers config (duck-typed)
        if not getattr(config, "base_model_tp_plan", None):  # e.g. GPT-2: an empty tp_plan and no base plan
            raise ConfigError(no_plan_sentence(model))
        base = dict(config.base_model_tp_plan)
        inner = getattr(model, getattr(model, "base_model_prefix", ""), None)
        lead = f"{model.base_model_prefix}." if isinstance(inner, nn.Module) and inner is not model else ""
        plan = {f"{lead}{k}": v for k, v in base.items()}
    lead = f"{prefix}." if prefix else ""
    return {f"{lead}{k}": str(v) for k, v in plan.items()}


def no_plan_sentence(model: nn.Module) -> str:
    """Why `tp_plan: auto` cannot split `model`, and which model families it can."""
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    why = (
        (
            "; its Conv1D layers (GPT-2's transposed linear layers) cannot be split colwise or rowwise at all, so give "
            "it no tp axis (shard it with dp_shard instead)"
        )
        if conv1d
        else ("; give strategy.tp_plan as a mapping of its nn.Linear / nn.Embedding layers to styles, or no tp axis")
    )
    return (
        f"{type(model).__name__} has no tensor-parallel plan in transformers (config.base_model_tp_plan), which "
        f"tp_plan: auto needs: it splits model families that define one, such as {', '.join(TP_FAMILIES)}{why}."
    )


def _pattern(text: str) -> re.Pattern[str]:
    parts = ["[^.]+" if part == "*" else re.escape(part).replace(r"\*", "[^.]*") for part in text.split(".")]
    return re.compile(r"\.".join(parts))


def resolve_plan(root: nn.Module, option: PlanOption, leave: Collection[str] = ()) -> dict[str, str]:
    """Module name in `root` -> style, every pattern matched and every style known (not yet
    checked against the TP size: see `check_plan`). Under auto, the model's patterns that name a module
    of `leave` or one of its parameters are dropped: another axis splits those (ep the experts)."""
    auto = option is None or option == "auto"
    if auto:
        plan = _auto_plan(root)
    elif isinstance(option, Mapping):
        plan = {str(k): str(v) for k, v in option.items()}
    else:
        raise ConfigError(
            f"strategy.tp_plan is {option!r}; give auto (the model's own plan) or a mapping of module-name "
            "patterns to styles such as {'layers.*.mlp.up_proj': 'colwise'}."
        )
    names = [name for name, _ in root.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if auto and _names_left(pattern, leave):
            continue
        if style in _REFUSED:
            raise ConfigError(
                f"strategy.tp_plan gives {pattern} the style {style!r}, which kiln does not take in a "
                f"mapping: {_REFUSED[style]}."
            )
        if style not in STYLES:
            raise ConfigError(
                f"strategy.tp_plan gives {pattern} the unknown style {style!r}; the styles are {', '.join(STYLES)}."
            )
        regex = _pattern(pattern)
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched and auto:  # a model's own plan may name optional layers this configuration lacks
            continue
        if not matched:
            raise ConfigError(
                f"strategy.tp_plan names {pattern!r}, which matches no module of {type(root).__name__}; "
                f"fix the pattern (module names look like {', '.join(_examples(names))})."
            )
        for name in matched:
            resolved.setdefault(name, style)  # the first pattern that names a module decides its style
    return {name: style for name, style in resolved.items() if style != "replicate"}


def _names_left(pattern: str, leave: Collection[str]) -> bool:
    """Whether `pattern` names a module of `leave`, or a parameter of one (its last component dropped)."""
    whole, owner = _pattern(pattern), _pattern(pattern.rpartition(".")[0])
    return any(whole.fullmatch(name) or owner.fullmatch(name) for name in leave)


def _examples(names: list[str]) -> list[str]:
    leaves = [n for n in names if not any(other.startswith(n + ".") for other in names)]
    return [repr(re.sub(r"\.\d+\.", ".*.", n)) for n in dict.fromkeys(re.sub(r"\.\d+\.", ".0.", n) for n in leaves)][:4]


def check_plan(root: nn.Module, plan: dict[str, str], tp: int) -> dict[str, str]:
    """Refuse a TP size the model's heads or a split layer cannot take (one sentence each); return the
    plan without layers whose weights are tied to a layer outside them."""
    _, model = hf_model(root)
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if plan and isinstance(heads, int):
        kv = getattr(config, "num_key_value_heads", None) or heads
        for what, count in (
            ("attention heads (num_attention_heads)", heads),
            ("key/value heads (num_key_value_heads)", kv),
        ):
            if count % tp:
                raise ConfigError(
                    f"tp {tp} does not divide the model's {count} {what}; choose a tp that divides both "
                    f"num_attention_heads ({heads}) and num_key_value_heads ({kv})."
                )
    owners: dict[int, set[str]] = {}
    for name, sub in root.named_modules(remove_duplicate=False):
        for p in sub._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(name)
    kept: dict[str, str] = {}
    for name, style in plan.items():
        layer = root.get_submodule(name)
        size = _split_size(name, layer, style)
        if size % tp:
            raise ConfigError(
                f"tp {tp} does not divide the {size} {_WHAT[STYLES[style]]} of {name} "
                f"({type(layer).__name__}) that tp_plan's {style!r} splits; choose a tp that divides {size}."
            )
        if any(owners[id(p)] - {name} for p in layer.parameters(recurse=False)):
            log.info(
                "tensor parallel: %s shares its weight with another layer (tied embeddings); it stays replicated.", name
            )
            continue
        kept[name] = style
    return kept


def _split_size(name: str, layer: nn.Module, style: str) -> int:
    side = STYLES[style]
    if isinstance(layer, nn.Linear) and side in ("out", "in"):
        return layer.out_features if side == "out" else layer.in_features
    if isinstance(layer, nn.Embedding) and side == "vocab":
        return layer.num_embeddings
    kind = "Embedding layers" if side == "vocab" else "Linear layers"
    raise ConfigError(
        f"strategy.tp_plan gives {name} ({type(layer).__name__}) the style {style!r}, which applies to "
        f"{kind} only; give it another style or leave it out of the plan."
    )


def parallel_styles(plan: dict[str, str]) -> dict[str, Any]:
    """The plan as torch.distributed.tensor.parallel styles (for `parallelize_module`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    make: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        # token ids come in whole (RowwiseParallel's default input layout is a split last dimension)
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return {name: make[style]() for name, style in plan.items()}


@dataclass
class TensorParallel:
    """What `apply_tp` did: how many layers it split, and the loss-parallel hooks (None: the head's
    logits are gathered whole)."""

    layers: int
    sequence_parallel: bool = False
    loss_parallel: Any | None = None  # loss_parallel.LossParallel


def apply_tp(
    root: nn.Module,
    tp_mesh: Any,
    option: PlanOption,
    tp: int,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    restyle: Callable[[nn.Module, Any], Any] | None = None,
    leave: Collection[str] = (),
) -> TensorParallel:
    """Resolve, check and apply the plan on `root` over `tp_mesh`, sequence-sharding the activations
    between its TP regions and keeping the head's logits split where asked (and derivable).
    `restyle(layer, style)`: the style a layer is really split with (the precision plugin's, for float8)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from kiln.strategies.mesh import loss_parallel as lp
    from kiln.strategies.mesh import sequence_parallel as sp

    plan = check_plan(root, resolve_plan(root, option, leave), tp)
    layout = sp.derive_layout(root, plan) if sequence_parallel else None  # refuses before anything is split
    head, model = None, hf_model(root)[1]
    if loss_parallel:
        head, why = lp.find_head(root, plan, model)
        if head is None:
            log.info("tensor parallel: loss_parallel is off, the head's logits are gathered whole: %s.", why)
    styles = parallel_styles(plan)
    if layout is not None:
        styles.update(sp.sequence_styles(layout, loss_parallel=head is not None))
    if head is not None:
        styles[head] = lp.head_style(sequence_parallel=layout is not None)
    if restyle is not None:
        styles = {name: restyle(root.get_submodule(name), style) for name, style in styles.items()}
    if plan:
        parallelize_module(root, tp_mesh, styles)
    if layout is not None:
        sp.gather_block_inputs(root, layout)
        sp.replicate_norm_gradients(root, layout)
    hooks = lp.LossParallel(model, root.get_submodule(head)) if head is not None and model is not None else None
    return TensorParallel(len(plan), layout is not None, hooks)


def parallelize_tp(
    user: nn.Module,
    mesh: Any,
    s: Any,
    tp: int,
    *,
    loaded_split: bool,
    restyle: Callable[[nn.Module, Any], Any] | None,
    leave: Collection[str] = (),
) -> tuple[str, Any | None]:
    """Tensor parallelism of the user's module over the mesh's `tp` axis, from one of three sources:
    transformers' split kept as it is (`loaded_split`), the TrainingModule's own `configure_model(mesh)`,
    or the plan (the mesh settings `s`: `tp_plan`, `sequence_parallel`, `loss_parallel`; the modules of
    `leave` and their parameters left out of an auto plan). Returns what was
    done, for the set-up log line, and the loss-parallel hooks (None: the head's logits are gathered whole)."""
    hook = getattr(user, "configure_model", None)
    if loaded_split:
        return f"the tensor parallelism transformers applied at load (tp {tp})", None
    if callable(hook):
        given = [
            key
            for key, on in (
                ("tp_plan", s.tp_plan is not None),
                ("sequence_parallel", s.sequence_parallel),
                ("loss_parallel", s.loss_parallel),
            )
            if on
        ]
        if given:
            raise ConfigError(
                f"{type(user).__name__} defines configure_model(mesh), which parallelises the model "
                f"itself, and strategy.{' and strategy.'.join(given)} {'is' if len(given) == 1 else 'are'}"
                " set too; drop one of them (configure_model can apply torch's SequenceParallel and "
                "loss_parallel itself)."
            )
        hook(mesh)  # the user's own parallelize code (TP, and FSDP on blocks if it wants)
        return "configure_model(mesh)", None
    if tp == 1:
        return "no tensor parallelism", None
    done = apply_tp(
        user,
        mesh["tp"],
        s.tp_plan,
        tp,
        sequence_parallel=s.sequence_parallel,
        loss_parallel=s.loss_parallel,
        restyle=restyle,
        leave=leave,
    )
    what = (
        f"{done.layers} tensor-parallel layer(s)"
        + (", sequence parallel" if done.sequence_parallel else "")
        + (", loss parallel" if done.loss_parallel is not None else "")
    )
    return what, done.loss_parallel
