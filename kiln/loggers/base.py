"""The Logger interface. Loggers are built on the global rank-0 process only (the Trainer builds
none elsewhere), so exactly one tracker run exists per job by construction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping

if TYPE_CHECKING:
    from omegaconf import DictConfig


class Logger:
    """Receives flat `{name: number}` metrics with the global step, and the resolved config once."""

    name: ClassVar[str] = "base"

    def __init__(self, config: "DictConfig") -> None:
        self.config = config

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """`params` is the resolved config, flattened to dotted keys."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def log_artifact(self, path: str) -> None:
        """Attach a file or folder (the final model) where the tracker supports it."""

    def finalize(self, status: str) -> None:
        """Flush and close; `status` is "success", "failed" or "interrupted"."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1e-3}} -> {'optim.lr': 1e-3}; lists become strings."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = str(list(value))
        else:
            out[name] = value
    return out
