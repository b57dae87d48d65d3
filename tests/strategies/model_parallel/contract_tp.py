"""`model_parallel_tp`: strategy model_parallel with tensor parallelism over every process, as the
contract suite runs it (tests/strategies/contract/). The suite hands a strategy over by name, with no
options, and its ContractNet is no Transformers model (no plan to take with `auto`): this subclass
only supplies the mesh and the plan a user would write in the config,

    strategy: {name: model_parallel, mesh: {tp: -1}, tp_plan: {mix: colwise, head: rowwise}}

so the suite checks tensor parallelism's numbers, checkpoints and export, not FSDP's alone (the
default mesh, which the suite runs as `model_parallel`). Registered by one line in
tests/strategies/contract/scenarios.py (`STRATEGIES.add_lazy`)."""

from __future__ import annotations

from typing import Any

from kiln.strategies import STRATEGIES
from kiln.strategies.model_parallel.strategy import ModelParallelStrategy

#: ContractNet's pair of Linear layers split as one TP block: `mix` by its output features (tanh
#: works on the split), `head` by its input features (its outputs are summed whole)
PRESET: dict[str, Any] = {"mesh": {"tp": -1}, "tp_plan": {"mix": "colwise", "head": "rowwise"}}


@STRATEGIES.register("model_parallel_tp")
class ContractTPStrategy(ModelParallelStrategy):
    name = "model_parallel_tp"

    def option(self, key: str, default: Any = None) -> Any:
        return super().option(key, PRESET.get(key, default))
