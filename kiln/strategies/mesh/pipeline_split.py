"""A Transformers decoder cut into pipeline stages (the `pp` axis, pipeline.py).

Kiln splits models shaped as Llama, Qwen2/3 and Mistral are: `<prefix>.embed_tokens`, a ModuleList
`<prefix>.layers` of decoder layers, `<prefix>.norm`, and `lm_head` beside the decoder. Stage 0 keeps
the embeddings, the last stage the final norm and the head, and every stage a contiguous run of
decoder layers (`stage_layers`). The model is pruned in place on each rank (`keep_stage`): what the
rank does not hold is dropped, and the layers it holds stay under their own indices (`StageLayers`),
so its `state_dict()` keys and the optimizer's are the full model's names -- a checkpoint's pieces
from every stage are one model's, which DCP loads on any other mesh, or on one process.

Each stage runs the decoder's own forward (`StageForward`, on a view of the decoder holding the stage's
layers: `stage_decoder`), on `inputs_embeds` after stage 0, so the causal mask and the rotary
embeddings are the model's own code's (the forward beneath Transformers' wrappers, which do nothing
for a stage's call and cost some 80 Python calls each time a stage runs: `bare_forward`). A rank may
hold several stages (the interleaved and zero-bubble schedules): it keeps the layers of all of them,
and each stage's view only its own. A model whose layers differ in attention type (`config.layer_types`
mixing full and sliding attention) is refused: the decoder picks a
layer's mask by its position in the list it iterates, which a stage's shorter list would shift."""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from kiln.utils.errors import ConfigError


class StageLayers(nn.ModuleDict):
    """The decoder layers one stage holds, keyed by their index in the full model (so that their
    parameters keep the full model's names); sliced, as the decoder's forward slices its ModuleList,
    it gives the held layers in order."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return list(self.values())[key]
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values())


def decoder_of(model: Any) -> Any:
    """The decoder (`model.model` for LlamaForCausalLM) of a model kiln can split; one sentence otherwise."""
    name = type(model).__name__
    prefix = getattr(model, "base_model_prefix", None)
    decoder = getattr(model, prefix, None) if isinstance(prefix, str) else None
    parts = ("embed_tokens", "layers", "norm")
    if (
        decoder is None
        or not all(isinstance(getattr(decoder, p, None), nn.Module) for p in parts)
        or not isinstance(decoder.layers, nn.ModuleList)
        or not isinstance(getattr(model, "lm_head", None), nn.Module)
    ):
        raise ConfigError(
            f"strategy.mesh.pp cannot split {name}: kiln splits Transformers decoders shaped as Llama, Qwen2/3 "
            "and Mistral are (embed_tokens, a layers list and norm in the decoder, lm_head beside it); "
            "train it without pp."
        )
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and decoder.embed_tokens.weight is model.lm_head.weight:
        raise ConfigError(
            f"strategy.mesh.pp cannot split {name}: its lm_head shares its weight with the embeddings "
            "(tie_word_embeddings), which would sit on the first and the last stage; load it with "
            "tie_word_embeddings=False, or train it without pp."
        )
    kinds = set(getattr(config, "layer_types", None) or ())
    if len(kinds) > 1:
        raise ConfigError(
            f"strategy.mesh.pp cannot split {name}: its layers mix attention types ({', '.join(sorted(kinds))}), "
            "which the decoder assigns by position in the layer list a stage shortens; train it without pp."
        )
    return decoder


def stage_layers(
    costs: Sequence[int], stages: int, split: Sequence[int] | None, *, first: int = 0, last: int = 0
) -> list[range]:
    """The decoder layers of each stage: contiguous runs, at least one layer each.

    `split` gives the index of each stage's first layer after stage 0 (pp - 1 of them); None balances:
    the largest stage's cost (the parameters of its layers, plus `first` on stage 0 -- the embeddings --
    and `last` on the last stage -- norm and head) as small as it can be, ties broken by the largest
    stage's layer count, then the earliest cuts."""
    n = len(costs)
    if n < stages:
        raise ConfigError(f"strategy.mesh.pp is {stages}, but the model has {n} decoder layer(s); give pp at most {n}.")
    if split is not None:
        cuts = list(split)
        if (
            len(cuts) != stages - 1
            or any(isinstance(c, bool) or not isinstance(c, int) for c in cuts)
            or [0, *cuts, n] != sorted(set([0, *cuts, n]))
        ):
            raise ConfigError(
                f"strategy.pipeline.split is {cuts!r}; give {stages - 1} increasing layer index(es) between 1 and "
                f"{n - 1} (where each stage after the first begins), or auto."
            )
        bounds = [0, *cuts, n]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    return _balanced(list(costs), stages, first, last)


def stage_owners(pp: int, stages: int, style: str) -> list[int]:
    """The pp rank of each stage, as torch's multi-stage schedules place them: "loop" puts stage s on
    rank s % pp (so rank r holds r, r + pp, ...), "v" (zbv, 2 stages a rank) runs down the ranks and
    back up, so rank r holds stages r and 2 pp - 1 - r (rank 0 the first and the last)."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(stages)]
    return [s % pp for s in range(stages)]


def stage_ranges(model: Any, decoder: Any, stages: int, split: Sequence[int] | None, mesh: Any) -> list[range]:
    """Each stage's decoder layers: the model's own `configure_pipeline(mesh)` when it defines one
    (a list of each stage's layer indices), else `split`, else the balanced split."""
    costs, first, last = auto_costs(model, decoder)
    hook = getattr(model, "configure_pipeline", None)
    if not callable(hook):
        return stage_layers(costs, stages, split, first=first, last=last)
    name = type(model).__name__
    if split is not None:
        raise ConfigError(
            f"{name} defines configure_pipeline(mesh), which gives the pipeline's split, and "
            "strategy.pipeline.split is set too; drop one of them."
        )
    given = [list(layers) for layers in hook(mesh)]
    ranges = [range(layers[0], layers[-1] + 1) if layers else range(0) for layers in given]
    if len(given) != stages or [i for layers in given for i in layers] != list(range(len(costs))) or not all(given):
        raise ConfigError(
            f"{name}.configure_pipeline(mesh) returned {given!r}; return {stages} list(s) of decoder layer indices, "
            f"one per stage, each a non-empty run that continues the one before, together 0 to {len(costs) - 1}."
        )
    return ranges


def _balanced(costs: list[int], stages: int, first: int, last: int) -> list[range]:
    """Min-max contiguous partition by dynamic programming over (stages used, layers used)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(k: int, a: int, b: int) -> tuple[int, int]:
        extra = (first if k == 0 else 0) + (last if k == stages - 1 else 0)
        return prefix[b] - prefix[a] + extra, b - a

    # best[k][b]: (worst cost, worst count, cuts) for layers [0, b) over stages 0..k
    best: list[dict[int, tuple[tuple[int, int], list[int]]]] = [{} for _ in range(stages)]
    for b in range(1, n - stages + 2):
        best[0][b] = (cost(0, 0, b), [])
    for k in range(1, stages):
        for b in range(k + 1, n - (stages - 1 - k) + 1):
            options = [
                (max(best[k - 1][a][0], cost(k, a, b)), [*best[k - 1][a][1], a])
                for a in range(k, b)
                if a in best[k - 1]
            ]
            best[k][b] = min(options, key=lambda o: (o[0], o[1]))
    bounds = [0, *best[stages - 1][n][1], n]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def layer_costs(decoder: Any) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in decoder.layers]


def auto_costs(model: Any, decoder: Any) -> tuple[list[int], int, int]:
    """Each layer's parameter count, and the extra held by the first stage (embeddings) and the last (norm, head)."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return layer_costs(decoder), count(decoder.embed_tokens), count(decoder.norm) + count(model.lm_head)


def keep_stage(model: Any, decoder: Any, layers: Iterable[int], *, first: bool, last: bool) -> None:
    """Prune `model` in place to what one rank holds: its stages' layers (under their own indices), the
    embeddings when it holds the first stage, the final norm and the head when it holds the last."""
    held = StageLayers({str(i): decoder.layers[i] for i in sorted(layers)})
    decoder.layers = held
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = nn.Identity()  # the decoder's forward applies it: the identity until the last stage
        model.lm_head = None


def stage_decoder(decoder: Any, layers: Sequence[nn.Module], *, first: bool, last: bool) -> Any:
    """A view of `decoder` that holds one stage's pieces only: a shallow copy sharing every module
    (the rotary embedding, the config) but with its own table of submodules, so that its forward runs
    the stage's layers alone and its `parameters()` are the stage's (a zero-bubble schedule computes
    each stage's weight gradients over exactly those). Its tables are its own, its hooks' too: a hook
    registered on one stage's view must not run when another stage of the same rank runs its view,
    nor on the decoder itself (kiln registers none there: `_shard_stages` leaves out direct_calls.py's)."""
    view = copy.copy(decoder)
    for name, value in vars(decoder).items():  # _modules, _parameters, _buffers, the hook dicts, ...
        if isinstance(value, (dict, set)):
            vars(view)[name] = copy.copy(value)
    view.layers = StageLayers({str(i): layer for i, layer in enumerate(layers)})
    if not first:
        view.embed_tokens = None
    if not last:  # a function, not nn.Identity: one call a forward in place of three, and a module fewer
        del view.norm  # for torch's stage to walk (its FSDP setters list every module, 3 times a backward)
        view.norm = _unchanged
    bare = bare_forward(view)
    if bare is not None:  # an instance attribute shadows the class's forward; the view's hooks still run
        view.forward = bare
    return view


def _unchanged(hidden: torch.Tensor) -> torch.Tensor:
    """The final norm of a stage before the last (the decoder's forward applies it)."""
    return hidden


#: Transformers' wrappers around a decoder's forward that do nothing for a stage's call: they fill
#: arguments from the config (use_cache, which the stage passes; is_causal, checked), rename deprecated
#: keywords (it passes none), capture per-layer outputs (it asks for none: it reads last_hidden_state)
#: and make the output a tuple (where the config says return_dict false, which that read needs not)
_INERT = (
    ("transformers.utils.generic", "merge_with_config_defaults", ()),
    ("transformers.utils.generic", "can_return_tuple", ()),
    ("transformers.utils.output_capturing", "capture_outputs", ()),
    ("transformers.utils.deprecation", "deprecate_kwarg", ("old", "0.0.0", "new")),
)
#: what merge_with_config_defaults would also read from the config for a forward taking these names
_VISION = ("vision_feature_layer", "vision_feature_select_strategy", "vision_aspect_ratio")


@functools.cache
def _inert_code() -> frozenset[Any]:
    """The code objects of the `_INERT` wrappers this Transformers has (each decorates a probe once)."""
    import importlib

    def probe(self: Any, *args: Any, **kwargs: Any) -> None: ...

    codes = set()
    for module, name, args in _INERT:
        try:
            decorator = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        codes.add((decorator(*args) if args else decorator)(probe).__code__)
    return frozenset(codes)


def bare_forward(decoder: Any) -> Any:
    """`decoder`'s forward beneath Transformers' wrappers (`_INERT`), bound to it: some 85 Python calls
    fewer each time a stage runs (a step of interleaved 1F1B at pp 2 runs 8 a rank). The same
    computation, as the wrappers change nothing in a stage's call; None (the stage keeps the decorated
    forward) where any other wrapper sits there, or the config sets what a wrapper would pass on."""
    f = type(decoder).forward
    inert = _inert_code()
    while hasattr(f, "__wrapped__"):
        if getattr(f, "__code__", None) not in inert:
            return None
        f = f.__wrapped__
    code = getattr(f, "__code__", None)
    if (
        f is type(decoder).forward
        or code is None
        or getattr(decoder.config, "is_causal", None) is not None
        or any(name in code.co_varnames for name in _VISION)
    ):
        return None
    return types.MethodType(f, decoder)


class StageForward(nn.Module):
    """One stage's forward, as `PipelineStage` calls it: stage 0 takes `input_ids`, the others the
    previous stage's hidden states; the last returns the logits. Runs in the precision's forward context.
    Its parameters are the stage's: those of `decoder` (a `stage_decoder` view) and of `head` on the last."""

    def __init__(self, decoder: nn.Module, head: nn.Module | None, precision: Any, *, first: bool, last: bool) -> None:
        super().__init__()
        self.decoder, self.head = decoder, head if last else None
        self.first, self.last, self.precision = first, last, precision

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with self.precision.forward_context():
            hidden = self.decoder(**given, attention_mask=attention_mask, use_cache=False).last_hidden_state
            return self.head(hidden) if self.head is not None else hidden
