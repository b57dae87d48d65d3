"""No launcher: a plain `python` process, alone in its job."""

from __future__ import annotations

from kiln.launch.environment.base import ClusterEnvironment, ClusterKind, Env


class NoLauncher(ClusterKind):
    name = "none"

    @classmethod
    def detects(cls, env: Env) -> bool:
        return True

    @classmethod
    def read(cls, env: Env) -> ClusterEnvironment:
        return ClusterEnvironment()
