"""Precision plugins, chosen by name (`precision: bf16`). Each file registers its own names; the
registry imports a plugin's file only when a config names it, so `import kiln` stays cheap."""

from kiln.registry import Registry

PRECISIONS: Registry[type] = Registry("precision plugin", "precision.name")

for _names, _module in (
    (("fp32", "32", "32-true", "no"), "kiln.precision.fp32"),
    (("fp16", "16-mixed", "16", "bf16", "bf16-mixed"), "kiln.precision.amp"),
    (("fp16-true", "16-true", "bf16-true"), "kiln.precision.half"),
    (("apex",), "kiln.precision.apex"),
):
    for _name in _names:
        PRECISIONS.add_lazy(_name, _module)


def build_precision(config, override=None):  # type: ignore[no-untyped-def]
    """Instantiate the plugin the config names; `override` may be a Precision class or instance."""
    from kiln.precision.base import Precision

    if isinstance(override, Precision):
        return override
    if isinstance(override, type) and issubclass(override, Precision):
        return override(config)
    return PRECISIONS.get(config.precision.name)(config)
