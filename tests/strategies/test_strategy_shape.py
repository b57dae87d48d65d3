"""The shape issue 53 asked of the strategies package, checked as code: the collectives of every
multi-process strategy come from one mixin (`ProcessGroupCollectives`), not from inheriting DDP; fsdp
and model_parallel are presets of one mesh strategy; and no strategy package imports another's
private names (xla once imported fsdp's)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kiln.strategies import STRATEGIES
from kiln.strategies.base import COLLECTIVES
from kiln.strategies.collectives import ProcessGroupCollectives
from kiln.strategies.ddp.strategy import DDPStrategy
from kiln.strategies.mesh.strategy import MeshStrategy

PACKAGE = Path(__file__).resolve().parents[2] / "kiln" / "strategies"


@pytest.mark.parametrize("name", ["ddp", "fsdp", "model_parallel", "deepspeed"])
def test_multi_process_strategies_take_their_collectives_from_the_mixin(name):
    if name == "deepspeed":
        pytest.importorskip("deepspeed")
    cls = STRATEGIES.get(name)
    assert issubclass(cls, ProcessGroupCollectives)
    assert cls is DDPStrategy or not issubclass(cls, DDPStrategy)
    for collective in COLLECTIVES:
        assert getattr(cls, collective) is getattr(ProcessGroupCollectives, collective) or issubclass(cls, MeshStrategy)


def test_fsdp_and_model_parallel_are_presets_of_the_mesh_strategy():
    fsdp, model_parallel = STRATEGIES.get("fsdp"), STRATEGIES.get("model_parallel")
    assert fsdp.__bases__ == model_parallel.__bases__ == (MeshStrategy,)
    for cls in (fsdp, model_parallel):  # a preset says how its config writes the mesh, nothing else
        own = {key for key in vars(cls) if not key.startswith("_")}
        # (resolve: which mesh strategy class those settings need, e.g. the pipeline one under mesh.pp)
        assert own <= {"name", "options", "settings", "read_settings", "mesh_request", "resolve"}, own


def _imports(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    ]


def test_no_strategy_package_imports_another_ones_private_names():
    for path in PACKAGE.rglob("*.py"):
        here = path.relative_to(PACKAGE).parts[0]
        for module, name in _imports(path):
            parts = module.split(".")
            if parts[:2] == ["kiln", "strategies"] and len(parts) > 2 and parts[2] != here:
                assert not name.startswith("_"), f"{path.relative_to(PACKAGE)} imports {module}.{name}"
            if here == "xla":
                assert parts[:3] != ["kiln", "strategies", "fsdp"], f"xla/{path.name} imports from {module}"
