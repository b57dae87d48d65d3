"""Precision plugins, chosen by name (`precision: bf16`). Each file registers its own names; the
registry imports a plugin's file only when a config names it, so `import kiln` stays cheap."""

from kiln.config.names import PRECISION_GROUPS
from kiln.registry import Registry, publish

PRECISIONS: Registry[type] = publish(Registry("precision plugin", "precision.name"))

#: each group of names in config's vocabulary (kiln.config.names) -> the module that registers it
for _names, _module in zip(
    PRECISION_GROUPS,
    (
        "kiln.precision.fp32",
        "kiln.precision.amp",
        "kiln.precision.half",
        "kiln.precision.apex",
        "kiln.precision.tf32",
        "kiln.precision.float8",
        "kiln.precision.mxfp8",
    ),
    strict=True,
):
    for _name in _names:
        PRECISIONS.add_lazy(_name, _module)


def build_precision(config, override=None):
    """Instantiate the plugin the config names; `override` may be a Precision class or instance.

    HF's `fp16: true` with `half_precision_backend: apex` means Apex AMP, so an fp16 name with that
    backend builds the apex plugin; bf16 has no apex path and is rejected rather than swapped."""
    from kiln.precision.base import Precision, PrecisionError

    if isinstance(override, Precision):
        return override
    if isinstance(override, type) and issubclass(override, Precision):
        return override(config)
    name = config.precision.name
    cls = PRECISIONS.get(name)
    backend = config.precision.half_precision_backend
    if backend == "apex" and cls.name in ("fp16", "bf16"):
        if cls.name == "bf16":
            raise PrecisionError(
                f"precision {name!r} cannot use half_precision_backend 'apex': apex AMP is fp16-only; "
                "set half_precision_backend to 'auto' for bf16, or use precision: fp16 with apex."
            )
        cls = PRECISIONS.get("apex")
    elif cls.name == "apex" and backend in ("cpu_amp", "cuda_amp"):
        raise PrecisionError(
            f"precision 'apex' contradicts half_precision_backend {backend!r}; use precision: fp16 for torch.amp, "
            "or set half_precision_backend to 'auto' or 'apex'."
        )
    return cls(config)
