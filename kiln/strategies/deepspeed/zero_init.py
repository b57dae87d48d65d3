"""Building a model under ZeRO-3's `deepspeed.zero.Init` (the strategy's `module_init_context`)
without losing its weight initialisation.

zero.Init partitions a module's parameters as soon as that module's constructor returns, so
initialisation that runs later on a child's parameters writes into an empty tensor and changes
nothing. DeepSpeed gathers around `Module.apply` itself (nanoGPT's `self.apply(init)`), but
Transformers initialises through its own recursion (`post_init` -> `initialize_weights` ->
`_initialize_weights` per module) and gathers only inside its own `from_config`/`from_pretrained`
ZeRO-3 path. `GPT2LMHeadModel(config)` called under kiln's zero.Init therefore kept torch's default
init (N(0, 1) embeddings tied to the head: loss 40, eval accuracy 0; issue 34). Here:

- `torch.nn.init.*` called on a partitioned parameter gathers it (nanoGPT's scaled projections);
- `_initialize_weights` gathers the module's partitioned parameters, runs on every rank (so the
  RNG advances as without ZeRO) and keeps rank 0's values, as DeepSpeed's `apply` wrapper does;
- Transformers is told an outer zero.Init is open (its own `set_zero3_state`, which exists to stop
  a nested zero.Init), so `from_config` builds exactly like calling the class instead of deferring
  initialisation to after construction in another order.

Every way then gives the weights of the same model built without ZeRO. The patches live only while
the context is open; Transformers' only when it is already imported (it is heavy), so a Transformers
model built under a context entered before Transformers was imported is refused at set-up.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from kiln.utils.errors import ConfigError

_TORCH_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


def not_available(param: Any) -> bool:
    """A ZeRO-3 parameter whose data is only this rank's partition (an empty tensor)."""
    status = getattr(param, "ds_status", None)
    return status is not None and getattr(status, "name", "") == "NOT_AVAILABLE"


@contextlib.contextmanager
def zero_init(
    deepspeed: Any, ds_config: dict[str, Any], record: Callable[[bool], None], *, partition: bool = True
) -> Iterator[None]:
    """deepspeed.zero.Init, with Transformers' initialisation gathered (see the module docstring).
    `partition=False` (`zero3_init_flag: false`): no zero.Init, and Transformers' `from_config` /
    `from_pretrained` build whole too, as the flag says. `record(True)` at exit means Transformers
    was first imported inside, unpatched."""
    had_transformers = "transformers" in sys.modules
    with contextlib.ExitStack() as stack:
        if partition:
            # zero.Init replaces torch.Tensor.__new__ while open; torch._dynamo imported for the first time
            # in there (Transformers' lazy model modules import it) rejects that signature and fails
            import torch._dynamo  # noqa: F401

            if had_transformers:
                stack.enter_context(_transformers_gathered(deepspeed))
            stack.enter_context(_torch_init_gathered(deepspeed))
            stack.enter_context(deepspeed.zero.Init(config_dict_or_path=ds_config))
        if had_transformers:
            stack.enter_context(_optional("transformers.modeling_utils", "set_zero3_state"))
        yield
    record(partition and not had_transformers and "transformers.modeling_utils" in sys.modules)


@contextlib.contextmanager
def _torch_init_gathered(deepspeed: Any) -> Iterator[None]:
    """`torch.nn.init.*` called on a parameter zero.Init already partitioned (nanoGPT's
    `for p in self.parameters(): nn.init.normal_(p, ...)` after building its blocks) gathers it, runs
    on every rank and keeps rank 0's values. Functions imported by name before the context opened,
    and writes through `.data` or `copy_`, are not seen (build whole: `zero3_init_flag: false`)."""
    from torch.nn import init

    originals = {name: getattr(init, name) for name in _TORCH_INITS if hasattr(init, name)}

    def gathered(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not not_available(tensor):
                return fn(tensor, *args, **kwargs)
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
                fn(tensor, *args, **kwargs)
            return tensor

        return call

    for name, fn in originals.items():
        setattr(init, name, gathered(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(init, name, fn)


@contextlib.contextmanager
def _transformers_gathered(deepspeed: Any) -> Iterator[None]:
    """PreTrainedModel._initialize_weights on gathered parameters, and RoPE `arange` buffers kept
    in their own dtype (Transformers' `prevent_arange_dtype_change`, entered before zero.Init)."""
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.__dict__["_initialize_weights"]

    def _initialize_weights(self: Any, module: nn.Module, is_custom_code: bool = False) -> None:
        if getattr(module, "_is_hf_initialized", False):
            return
        params = {id(p): p for p in _initialised_by(module) if not_available(p)}
        if not params:
            return original(self, module, is_custom_code)
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
            original(self, module, is_custom_code)

    PreTrainedModel._initialize_weights = _initialize_weights  # type: ignore[method-assign]  # patched for this block only
    try:
        with _optional("transformers.integrations.deepspeed", "prevent_arange_dtype_change"):
            yield
    finally:
        PreTrainedModel._initialize_weights = original  # type: ignore[method-assign]  # restored


def _initialised_by(module: nn.Module) -> list[nn.Parameter]:
    """The parameters one `_init_weights(module)` call may write: the module's own and its direct
    children's (e.g. `attn.q_proj.weight`), except children that are models with their own init."""
    from transformers.modeling_utils import PreTrainedModel

    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, PreTrainedModel):
            params.extend(child.parameters(recurse=False))
    return params


def _optional(module: str, name: str) -> contextlib.AbstractContextManager[Any]:
    """A Transformers context manager by name, or nothing in a version without it."""
    factory = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name, None)
    return factory() if factory is not None else contextlib.nullcontext()


def refuse_unpatched(module: nn.Module) -> None:
    """One sentence, before training, for a Transformers model built under zero.Init when
    Transformers was first imported inside the model factory (its initialisation ran on empty
    partitions, which cannot be repaired afterwards)."""
    from transformers.modeling_utils import PreTrainedModel

    built = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
    if built is not None:
        raise ConfigError(
            f"{type(built).__name__} was built under ZeRO-3's zero.Init before Transformers was imported, so its "
            "weights were never initialised; import transformers before creating the Trainer (e.g. at the top "
            "of the module naming task.model) or set strategy.zero3_init_flag: false."
        )
