"""What parity cannot see, recorded inside the model while it trains and evaluates: the layout
(DTensor placements, or a plain tensor, and the local shape) of the activations where sequence and
loss parallelism change them -- the norms' inputs, the attention/MLP blocks' outputs, the input of a
colwise layer, the logits -- and the placements of the parameters after training. Hooks go on
before the Trainer sets the model up; pre-hooks are prepended so they see each input before the
parallel styles' own hooks change it. JSON-ready (placements as their repr)."""

from __future__ import annotations

from typing import Any

import torch

NORMS = (
    "model.layers.0.input_layernorm",
    "model.layers.0.post_attention_layernorm",
    "model.layers.1.input_layernorm",
    "model.norm",
)
BLOCKS = ("model.layers.0.self_attn", "model.layers.0.mlp")
COLWISE = "model.layers.0.self_attn.q_proj"
PARAMS = ("model.norm.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight", "model.embed_tokens.weight")


def layout(x: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return {
            "placements": [repr(p) for p in x.placements],
            "local": list(x.to_local().shape),
            "global": list(x.shape),
        }
    return {"placements": None, "local": list(x.shape), "global": list(x.shape)}


def _loss_parallel_on() -> bool:
    """Whether torch's loss_parallel() is in force: its cross-entropy handlers are DTensor's (private,
    but the only trace it leaves; without them a split logits' cross entropy silently gathers the vocab)."""
    from torch.distributed.tensor import DTensor

    return torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers


def _mode(module: torch.nn.Module) -> str:
    return "train" if module.training and torch.is_grad_enabled() else "eval"


def watch(llm: torch.nn.Module) -> dict[str, Any]:
    """Hooks on `llm` (a LlamaForCausalLM) that fill the returned dict with the first layout seen
    per place and mode: `"<train|eval> <place>"`."""
    seen: dict[str, Any] = {}

    def note(module: torch.nn.Module, place: str, x: Any) -> None:
        seen.setdefault(f"{_mode(module)} {place}", layout(x))

    def on_input(place: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            note(module, place, args[0] if args else kwargs["hidden_states"])

        return hook

    def on_output(place: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            note(module, place, output[0] if isinstance(output, tuple) else output)

        return hook

    for name in (*NORMS, COLWISE, *BLOCKS):
        llm.get_submodule(name).register_forward_pre_hook(on_input(f"{name} input"), prepend=True, with_kwargs=True)
    for name in BLOCKS:
        llm.get_submodule(name).register_forward_hook(on_output(f"{name} output"))

    def logits(module: torch.nn.Module, args: tuple, output: Any) -> None:
        split = output[1] if isinstance(output, tuple) else output.logits  # return_dict=False: (loss, logits, ...)
        note(module, "logits", split)
        mode = _mode(module)
        seen.setdefault(f"{mode} loss_parallel in forward", _loss_parallel_on())
        if split.requires_grad:

            def backward(grad: Any) -> None:
                seen.setdefault(f"{mode} loss_parallel in backward", _loss_parallel_on())

            split.register_hook(backward)

    llm.register_forward_hook(logits)
    return seen


def parameters(model: torch.nn.Module) -> dict[str, Any]:
    """The mesh and placements of a few parameters (None: a plain tensor)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for full, p in model.named_parameters():
        name = next((want for want in PARAMS if full == want or full.endswith("." + want)), None)
        if name is not None:
            out[name] = (
                [list(p.device_mesh.mesh_dim_names), [repr(x) for x in p.placements]]
                if isinstance(p, DTensor)
                else None
            )
    return out


def watch_loss(trainer: Any, seen: dict[str, Any]) -> None:
    """Record the type of the first training loss the engine gets from the model (a plain tensor:
    the loss-parallel DTensor must not leak into kiln's weighting, logging and backward)."""
    compute_loss = trainer.compute_loss

    def recorded(*args: Any, **kwargs: Any) -> Any:
        loss = compute_loss(*args, **kwargs)
        if trainer.model.training:
            seen.setdefault("train loss type", type(loss[0] if isinstance(loss, tuple) else loss).__name__)
        return loss

    trainer.compute_loss = recorded
