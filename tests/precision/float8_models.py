"""Tiny models for the float8 tests: a Llama built from a config (no download) whose key/value projections
are 8 wide (one kv head of 8), so they are the layers float8 must skip for their dimensions, and a learnable
token task."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln import TrainingModule
from tests.engine.packing.tiny import VOCAB

#: the Linear layers of the tiny Llama that `precision: fp8` converts: k_proj/v_proj are 32 -> 8 (not a
#: multiple of 16) and lm_head is excluded by default
CONVERTED = sorted(
    f"model.layers.{i}.{proj}"
    for i in range(2)
    for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
)


def tiny_llama(seed: int = 0) -> Any:
    import transformers as T

    from tests.engine.packing.tiny import config

    llama = config("llama")  # hidden 32, 4 heads of 8, intermediate 64, 2 layers, vocab VOCAB
    llama.num_key_value_heads = 1
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(llama)


def progressions(n: int = 64, length: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences start, start + k, start + 2k, ... (mod VOCAB) with k in 1..3: each next token follows
    from the two before it, so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start, step = int(torch.randint(VOCAB, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        ids = (start + step * torch.arange(length)) % VOCAB
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


class Float8Regressor(TrainingModule):
    """Linear 16 -> 32 and 32 -> 32 (converted), then 32 -> 1 (skipped: 1 is not a multiple of 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: dict) -> torch.Tensor:
        return F.mse_loss(self(batch["x"]), batch["y"])


def hand_float8_sgd(
    data: list[dict[str, torch.Tensor]], *, steps: int, batch: int, world: int, lr: float, seed: int, recipe: str
) -> nn.Module:
    """torchao by hand, without kiln: a Float8Regressor (seed 0) converted with `convert_to_float8_training`,
    forward under bf16 autocast with each float8 layer's input cast to bf16 (what autocast does for a linear
    layer), SGD. With `world` > 1 it is DDP's arithmetic in one process: each rank's shard of `batch` samples
    (kiln's sampler order) gives its own gradient, float8 scales computed from that shard alone, and the
    gradients are averaged."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from kiln.engine.data.samplers import ResumableSampler

    torch.manual_seed(0)
    model = Float8Regressor()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model.net, module_filter_fn=lambda _, name: name in ("0", "2"), config=config)
    net = model.net
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    orders = [ResumableSampler(len(data), seed=seed, num_replicas=world, rank=r).indices() for r in range(world)]
    for step in range(steps):
        for order in orders:
            shard = _shard(data, order, step, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = net[3](net[2](net[1](net[0](shard["x"].bfloat16())).bfloat16()))
                loss = F.mse_loss(net[4](hidden).squeeze(-1), shard["y"])
            loss.backward()
        for p in model.parameters():
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
    return model


class Float8LossNet(nn.Module):
    """Float8Regressor's layers as a plain module that returns its loss: what FSDP2 shards at its root."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.net(x).squeeze(-1), y)}


def _shard(data: list[dict[str, torch.Tensor]], order: list[int], step: int, batch: int) -> dict[str, torch.Tensor]:
    from torch.utils.data import default_collate

    return default_collate([data[i] for i in order[step * batch : (step + 1) * batch]])


def hand_float8_fsdp_sgd(
    data: list[dict[str, torch.Tensor]], *, steps: int, batch: int, lr: float, seed: int
) -> nn.Module:
    """torchtitan's recipe by hand on the process group kiln's run left (no kiln in the loop): a
    Float8LossNet (seed 0) converted with torchao's float8 all-gather for FSDP, `fully_shard` over every rank
    with bf16 parameters and fp32 gradient reduction, each rank on its shard of the sampler's order, SGD, and
    the weight scales precomputed after each step."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from kiln.engine.data.samplers import ResumableSampler

    torch.manual_seed(0)
    model = Float8LossNet()
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True, enable_fsdp_float8_all_gather=True
    )
    convert_to_float8_training(model.net, module_filter_fn=lambda _, name: name in ("0", "2"), config=config)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    world, rank = dist.get_world_size(), dist.get_rank()
    order = ResumableSampler(len(data), seed=seed, num_replicas=world, rank=rank).indices()
    for step in range(steps):
        model(**_shard(data, order, step, batch))["loss"].backward()
        optimizer.step()
        precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad()
    return model


def hand_float8_tp_sgd(
    data: list[dict[str, torch.Tensor]], *, steps: int, batch: int, lr: float, seed: int, recipe: str
) -> nn.Module:
    """torchtitan's float8 tensor parallelism by hand over every rank of the process group (no kiln in the
    loop): a Float8LossNet (seed 0) converted, each float8 layer's input cast to bf16 (autocast's rule for a
    linear layer), then its first layer split colwise and its second rowwise, with torchao's float8 styles
    under the tensorwise recipe and torch's under the rowwise ones; every rank reads the whole batch, bf16
    autocast, SGD."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from kiln.engine.data.loaders import ResumableSampler

    torch.manual_seed(0)
    model = Float8LossNet()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model.net, module_filter_fn=lambda _, name: name in ("0", "2"), config=config)
    for layer in (model.net[0], model.net[2]):
        layer.register_forward_pre_hook(lambda _, args: (args[0].bfloat16(),))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    colwise, rowwise = (
        (Float8ColwiseParallel, Float8RowwiseParallel) if recipe == "tensorwise" else (ColwiseParallel, RowwiseParallel)
    )
    parallelize_module(model, mesh, {"net.0": colwise(), "net.2": rowwise()})
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    order = ResumableSampler(len(data), seed=seed, num_replicas=1, rank=0).indices()
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**_shard(data, order, step, batch))["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def hand_float8_tp_fsdp_sgd(
    data: list[dict[str, torch.Tensor]], *, steps: int, batch: int, lr: float, seed: int, recipe: str
) -> nn.Module:
    """torchtitan's float8 under tp x dp_shard by hand over every rank of the process group (no kiln in the
    loop): a Float8LossNet (seed 0) converted, its first layer split colwise and its second rowwise over the
    `tp` axis, then `fully_shard` over the `dp_shard` axis (ranks in the same order as kiln's mesh: tp
    innermost) with bf16 parameters and fp32 gradient reduction, each dp rank on its shard of the sampler's
    order, SGD. Under the tensorwise recipe the weights are all-gathered in float8, the splits are torchao's
    float8 styles and the weight scales are precomputed after each step; under the rowwise ones the
    all-gather is bf16 and the styles are torch's."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from kiln.engine.data.samplers import ResumableSampler

    torch.manual_seed(0)
    model = Float8LossNet()
    tensorwise = recipe == "tensorwise"
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), emulate=True, enable_fsdp_float8_all_gather=tensorwise
    )
    convert_to_float8_training(model.net, module_filter_fn=lambda _, name: name in ("0", "2"), config=config)
    dp = dist.get_world_size() // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp_shard", "tp"))
    colwise, rowwise = (
        (Float8ColwiseParallel, Float8RowwiseParallel) if tensorwise else (ColwiseParallel, RowwiseParallel)
    )
    parallelize_module(model, mesh["tp"], {"net.0": colwise(), "net.2": rowwise()})
    fully_shard(
        model,
        mesh=mesh["dp_shard"],
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    order = ResumableSampler(len(data), seed=seed, num_replicas=dp, rank=mesh["dp_shard"].get_local_rank()).indices()
    for step in range(steps):
        model(**_shard(data, order, step, batch))["loss"].backward()
        optimizer.step()
        if tensorwise:
            precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad()
    return model


class MXRegressor(TrainingModule):
    """Linear 32 -> 64 and 64 -> 32 without bias (converted by mxfp8: torchao's own conversion, the reference,
    drops a bias), then 32 -> 1 (skipped: 1 is not a multiple of 32)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 64, bias=False), nn.Tanh(), nn.Linear(64, 32, bias=False), nn.Tanh(), nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: dict) -> torch.Tensor:
        return F.mse_loss(self(batch["x"]), batch["y"])


def hand_mxfp8_sgd(
    data: list[dict[str, torch.Tensor]], *, steps: int, batch: int, lr: float, seed: int, world: int = 1
) -> nn.Module:
    """torchao by hand, without kiln: an MXRegressor (seed 0) converted with torchao's public API
    (`quantize_` with the emulated MXFP8 recipe) on its first two layers, each called with its input and
    weight cast to bf16 (autocast's rule for a linear layer; torchao's wrapped weight keeps its MXFP8 matmul
    through the cast), bf16 autocast, SGD, kiln's sampler order; with `world` > 1, DDP's arithmetic in one
    process (each rank's shard gives its own gradient, and the gradients are averaged)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    from kiln.engine.data.loaders import ResumableSampler

    torch.manual_seed(0)
    model = MXRegressor()
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantize_(model.net, config, filter_fn=lambda _, name: name in ("0", "2"))
    net = model.net
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    orders = [ResumableSampler(len(data), seed=seed, num_replicas=world, rank=r).indices() for r in range(world)]
    for step in range(steps):
        for order in orders:
            shard = _shard(data, order, step, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = shard["x"]
                for layer in (net[0], net[2]):
                    hidden = torch.tanh(F.linear(hidden.bfloat16(), layer.weight.to(torch.bfloat16)))
                loss = F.mse_loss(net[4](hidden).squeeze(-1), shard["y"])
            loss.backward()
        for p in model.parameters():
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
    return model
