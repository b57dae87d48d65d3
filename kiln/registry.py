"""One small name -> object registry, shared by strategies, precision plugins, loggers, optimizers
and schedulers. Lookups of unknown names fail with the list of valid names, so a typo in a config
file is caught before any work starts."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: config key -> the registry a plug-in floor published for it (see `publish`)
_PUBLISHED: dict[str, Registry[Any]] = {}


class UnknownNameError(ValueError):
    """A config names a strategy/precision/optimizer/... that no registry entry provides."""


class Registry(Generic[T]):
    """Maps lower-case names (and aliases) to registered objects.

    `kind` is the human word used in error messages ("strategy", "precision plugin", ...), and
    `config_key` the config key a user would edit to fix the error.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: `@STRATEGIES.register("ddp", "ddp_spawn")`."""

        def deco(obj: T) -> T:
            for name in names:
                self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        key = name.lower()
        if key in self._entries and self._entries[key] is not obj:
            raise ValueError(f"{self.kind} name {name!r} is registered twice")
        self._entries[key] = obj

    def add_lazy(self, name: str, module: str) -> None:
        """Register `name` as provided by `module`, imported on first lookup.

        This keeps `import kiln` cheap: strategy files that import deepspeed or torch_xla are only
        imported when a config names them."""
        self._lazy[name.lower()] = module

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._lazy))

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._entries or name.lower() in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def check(self, name: str) -> None:
        """Raise UnknownNameError (listing valid names) without importing anything."""
        if str(name).lower() not in self:
            close = difflib.get_close_matches(str(name).lower(), self.names(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(
                f"Unknown {self.kind} {name!r} in `{self.config_key}`.{hint} Valid names: {', '.join(self.names())}."
            )

    def get(self, name: str) -> T:
        self.check(name)
        key = str(name).lower()
        if key not in self._entries:
            import importlib

            module = self._lazy[key]
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name != module:
                    raise
                raise UnknownNameError(
                    f"The {self.kind} {name!r} is not implemented in this version of kiln ({module} is missing)."
                ) from None
            if key not in self._entries:
                raise UnknownNameError(f"{module} did not register the {self.kind} {name!r}.")
        return self._entries[key]


def publish(registry: Registry[T]) -> Registry[T]:
    """Make `registry` the one whose names a config may give at `registry.config_key`. The floors that
    implement plug-ins publish theirs; config's validation reads the names registered at run time through
    `published_names` (kiln.config.names), so it never imports the floors above it."""
    _PUBLISHED[registry.config_key] = registry
    return registry


def published_names(config_key: str) -> list[str]:
    """The names of the registry published for `config_key`; none while its floor is not imported (then
    nothing can have been registered in it)."""
    registry = _PUBLISHED.get(config_key)
    return registry.names() if registry is not None else []
