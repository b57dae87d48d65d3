"""A model transformers split at load (`from_pretrained(..., tp_plan="auto")`, HF's way of giving the Trainer a
tensor-parallel model: trainer.py reads `model.tp_size`): kiln picks model_parallel over its tp size under
strategy auto, trains it as `single` trains the same weights (2 gloo processes, a tiny Llama), writes DCP
checkpoints that one process resumes, and refuses in one sentence what it cannot train: another strategy,
another mesh, a tp_plan on top, another world size, or transformers' own FSDP / replica / pipeline axes."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from torch import nn

from kiln.config import load_config
from kiln.strategies.mesh.presharded import adopt_loaded_model
from kiln.utils.errors import ConfigError
from tests.strategies.model_parallel import cases
from tests.strategies.model_parallel.conftest import checkpoint
from tests.strategies.model_parallel.test_model_parallel import _same_run, _same_weights

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("model-parallel-worlds")  # conftest.py's worlds, shared with test_model_parallel


@pytest.mark.distributed
def test_a_model_split_at_load_trains_like_one_process_and_resumes_on_one(tp_two, tp_one, tmp_path):
    """Run in the worlds test_model_parallel.py reads (conftest.py): no world of its own."""
    results, weights, out = tp_two
    got = results["loaded_tp2"]
    assert got["strategy"] == "ModelParallelStrategy" and got["data_shards"] == 1  # both ranks read the same batches
    assert got["tp_split"] == 2 * 7 + 2  # transformers' split, kept: the layers, the embedding and the head
    single = cases.run_case("single", str(tmp_path / "single"))
    _same_run(got, single[0])
    _same_weights(weights["loaded_tp2"], single[1], 1e-4)  # AdamW magnifies the float order of TP's sums (see hook)
    ckpt = checkpoint(out, "loaded_tp2")
    assert json.loads((ckpt / "COMPLETE").read_text())["format"] == "fsdp-sharded"
    resumed, resumed_weights, _ = tp_one
    assert resumed["resume_from_loaded"]["losses"][:2] == pytest.approx(got["losses"][:2], rel=1e-6)
    _same_weights(resumed_weights["resume_from_loaded"], weights["loaded_tp2"], 1e-6)


class _Split(nn.Module):
    """What the strategy sees of a model transformers distributed at load."""

    def __init__(self, tp: int = 2, **axes: int) -> None:
        super().__init__()
        self._is_distributed_loading_by_transformers = True
        self.tp_size = axes.pop("model_tp", tp)
        self.config = SimpleNamespace(distributed_config=SimpleNamespace(tp_size=tp, **axes))


@pytest.mark.parametrize(
    "cfg, model, world, words",
    [
        (
            {"strategy": {"name": "ddp"}},
            _Split(),
            2,
            "strategy 'ddp' cannot train a model whose layers are already DTensors",
        ),
        ({}, _Split(), 4, "this run has 4 processes; a loaded model trains with tensor parallelism only, so start 2"),
        (
            {"strategy": {"name": "model_parallel", "options": {"mesh": {"dp_shard": 2, "tp": 2}}}},
            _Split(),
            2,
            r"strategy.mesh is \{'dp_shard': 2, 'tp': 2\}; drop strategy.mesh or set it to \{tp: 2\}",
        ),
        (
            {"strategy": {"name": "model_parallel", "options": {"tp_plan": "auto"}}},
            _Split(),
            2,
            "drop strategy.tp_plan",
        ),
        ({}, _Split(fsdp_size=2), 4, "with fsdp_size 2; kiln takes over only the tensor parallelism"),
        ({}, _Split(pp_size=2, ep_size=2), 8, "with pp_size 2, ep_size 2;"),
    ],
)
def test_what_cannot_train_a_model_split_at_load_is_refused(cfg, model, world, words):
    with pytest.raises(ConfigError, match=words):
        adopt_loaded_model(load_config(cfg), model, world)


def test_strategy_auto_becomes_model_parallel_over_the_loaded_tp_size():
    """The loaded config is read-only: the settled strategy is a new config, and the one given is left as it was."""
    for cfg in (
        {},
        {"strategy": {"name": "model_parallel"}},
        {"strategy": {"name": "model_parallel", "options": {"mesh": {"tp": 2, "dp_shard": 1}}}},
    ):
        given = load_config(cfg)
        config = adopt_loaded_model(given, _Split(), 2)
        assert config.strategy.name == "model_parallel" and dict(config.strategy.options.mesh) == {"tp": 2}
        assert given.strategy.name == cfg.get("strategy", {}).get("name", "auto")
    config = adopt_loaded_model(load_config({}), _Split(model_tp=None), 2)  # no tp_size: its DistributedConfig's
    assert dict(config.strategy.options.mesh) == {"tp": 2}
    plain = load_config({})
    assert adopt_loaded_model(plain, nn.Linear(2, 2), 2) is plain  # any other model: the config as given


def test_only_a_model_split_at_load_skips_the_weight_broadcast_and_the_plan():
    """Any other model is still synced from rank 0 and split by kiln (each rank may have built other weights)."""
    from kiln.strategies.mesh.presharded import is_loaded_split

    assert is_loaded_split(_Split()) is True
    assert is_loaded_split(nn.Linear(2, 2)) is False and is_loaded_split(cases.llama()) is False


def test_a_plain_model_never_loads_this_module(tmp_path):
    """The Trainer asks every model whether transformers split it; for any other model the answer costs no import."""
    import subprocess

    code = (
        "import sys, torch; from kiln import Trainer; "
        f"Trainer(torch.nn.Linear(2, 1), {{'output_dir': {str(tmp_path)!r}, 'strategy': {{'device': 'cpu'}}}}); "
        "print('kiln.strategies.mesh.presharded' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
