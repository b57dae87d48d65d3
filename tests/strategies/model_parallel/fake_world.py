"""What the mesh really is, seen from one rank of a large world without starting it: torch's fake
process group (every collective is a no-op) lets one process play rank R of W, so the strategy builds
its DeviceMesh, applies the tensor-parallel plan and FSDP2 exactly as it would on W processes, and we
record what parity tests cannot see: the mesh's dimension names and sizes, the data-parallel group
and data shard of the rank, and each parameter's mesh, placements and local shard size.

With cp > 1 the model is cp_cases.TokenLocalLM (the tiny Llama's SDPA is refused on CPU), and the
description adds what this rank's cp position does: its cp rank and item shards, the chunk of a
known batch `batch_to_device` gives it in training (token indices read back from input_ids,
position_ids, shift_labels) and that an SDPA call inside `micro_batch_context` is refused on CPU.

Usage: python fake_world.py JSON, JSON being a list of [world, rank, mesh(, bf16(, options))], options
being strategy options (`sequence_parallel`, `loss_parallel`) plus `tie_word_embeddings` for the
model; prints a JSON list with one description each (one fake world after the other in this process)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))


def describe(
    world: int, rank: int, mesh: dict[str, int], bf16: bool = False, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    import logging

    import torch.distributed as dist
    from omegaconf import read_write
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies.model_parallel.strategy import ModelParallelStrategy
    from tests.strategies.model_parallel.cases import llama, llama_config
    from tests.strategies.model_parallel.cp_cases import TokenLocalLM

    options = dict(options or {})
    tie = options.pop("tie_word_embeddings", False)
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("kiln.strategies")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # built for this 1-process launch, then given the mesh: the group made here decides the world
    cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu"}, "bf16": bf16})
    strategy = ModelParallelStrategy(cfg, build_precision(cfg))
    with read_write(cfg):  # read-only once loaded; the strategy reads the mesh when it sets up
        cfg.strategy.options.mesh = mesh
    for key, value in options.items():  # after the constructor, which checks them against its own (1-process) mesh
        setattr(strategy.settings, key, value)
    strategy.setup_environment()
    precision = strategy.connect_precision(build_precision(cfg))  # as the Trainer does, on this world's mesh
    cp = mesh.get("cp", 1) > 1
    if cp:
        model = strategy.setup_module(TokenLocalLM())
    elif tie:
        from transformers import LlamaForCausalLM

        config = llama_config()
        config.tie_word_embeddings = True
        model = strategy.setup_module(LlamaForCausalLM(config))
    else:
        model = strategy.setup_module(llama())
    device_mesh = strategy.device_mesh
    params = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            params[name] = {
                "mesh": list(p.device_mesh.mesh_dim_names),
                "placements": [repr(x) for x in p.placements],
                "local": list(p.to_local().shape),
                "global": list(p.shape),
            }
        else:
            params[name] = {"mesh": None, "placements": None, "local": list(p.shape), "global": list(p.shape)}
    group = strategy._dp_group
    out = {
        "names": list(device_mesh.mesh_dim_names),
        "sizes": list(device_mesh.shape),
        "coordinate": device_mesh.get_coordinate(),
        "data_shards": strategy.data_shards,
        "data_shard_rank": strategy.data_shard_rank,
        "grad_divisor": strategy.grad_divisor,
        "dp_group": None if group is None else dist.get_process_group_ranks(group),
        "params": params,
        "precision": type(precision).__name__,
        "fsdp_param_dtypes": sorted(
            {str(m._get_fsdp_state()._mp_policy.param_dtype) for m in model.modules() if isinstance(m, FSDPModule)}
        ),
        # FSDP2 keeps a unit's gathered parameters after forward unless it reshards (ZeRO-3's memory)
        "reshard_after_forward": sorted(
            {
                m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                for m in model.modules()
                if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
            }
        ),
        "loss_parallel": strategy._loss_parallel is not None,
        "logs": logs,
    }
    logger.removeHandler(handler)
    out["sdpa"] = _sdpa(strategy, model)  # without cp, plain SDPA runs inside the micro-batch context
    if cp:
        out.update(_cp_probe(strategy, model))
    strategy.teardown()
    dist.destroy_process_group()
    return out


def _cp_probe(strategy: Any, model: Any) -> dict[str, Any]:
    import torch

    ids = torch.arange(16).view(2, 8)  # token t of row b is 8b + t: the chunk names its own indices
    labels = ids + 100
    model.train()
    train = strategy.batch_to_device({"input_ids": ids, "labels": labels})
    model.eval()
    whole = strategy.batch_to_device({"input_ids": ids, "labels": labels})
    model.train()
    return {
        "cp_rank": strategy._cp_rank,
        "item_shards": strategy.item_shards,
        "chunk": {k: v.tolist() for k, v in train.items()},
        "eval_keys": sorted(whole),
        "eval_ids": whole["input_ids"].tolist(),
    }


def _sdpa(strategy: Any, model: Any) -> str:
    """ "ran", or the sentence an SDPA call inside `micro_batch_context` fails with (under cp on CPU)."""
    import torch

    from kiln.utils.errors import ConfigError

    q = torch.randn(1, 2, 4, 8)
    try:
        with strategy.micro_batch_context(model, boundary=True):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return "ran"
    except ConfigError as err:
        return str(err)


if __name__ == "__main__":
    print(json.dumps([describe(*spec) for spec in json.loads(sys.argv[1])]))
