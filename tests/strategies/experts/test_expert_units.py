"""The expert axis without a spawned world (the 2-process run is test_expert_parity.py):

- the mesh: `ep` parsed, placed after dp_shard, counted as a data axis, and refused beside cp or pp
  or beside two of dp_replicate, dp_shard and tp, in one sentence; `model_parallel` resolves to its
  expert-parallel class;
- what cannot run under ep is refused before any process group starts, in one sentence each: a
  dense model, experts that do not divide over ep, an expert layout the forward does not run, and the
  settings and precisions not wired in;
- the expert-parallel forward on a 1-rank group (its all-to-alls move nothing, the sorting,
  regrouping, gating and combining are all there) gives the logits, loss and gradients of
  transformers' own forward for Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3, and counts each expert's
  tokens while training only; its weights' local pieces give DTensor's own gradient, bitwise;
- one rank of a fake 4-process world, ep 4 alone, ep 2 within dp_shard 4 and ep 2 beside
  dp_replicate 2: its mesh coordinate, data shard, its groups, which expert rows it holds, how FSDP
  shards the rest, and which group each gradient is reduced over (torch's fake process group); within an evaluation `generate()` runs with synced_gpus (ep 4 alone)."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.strategies.mesh.dims import ParallelDims, parse_mesh
from kiln.utils.errors import ConfigError
from tests.strategies.experts.cases import moe


def test_ep_is_a_data_axis_after_dp_shard():
    dims = parse_mesh({"ep": -1}, 4)
    assert dims == ParallelDims(ep=4) and (dims.dp, dims.dp_cp, dims.stage_ranks) == (4, 4, 4)
    assert not dims.fsdp and [dims.data_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert dims.mesh_axes() == (("dp_replicate", "dp_shard", "ep", "cp", "tp"), (1, 1, 4, 1, 1))
    assert dims.describe() == "ep 4"
    assert parse_mesh({"ep": 2}, 2).mesh_axes() == (("dp_replicate", "dp_shard", "ep", "cp", "tp"), (1, 1, 2, 1, 1))


def test_ep_within_dp_shard_borrows_its_ranks():
    dims = parse_mesh({"dp_shard": 4, "ep": 2}, 4)
    assert dims == ParallelDims(dp_shard=4, ep=2) and dims.ep_in_dp_shard and dims.fsdp
    assert (dims.dp, dims.dp_cp, dims.stage_ranks) == (4, 4, 4)
    assert [dims.data_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert dims.mesh_axes() == (("dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp"), (1, 2, 2, 1, 1))
    assert dims.describe() == "dp_shard 4 with ep 2"
    assert parse_mesh({"dp_shard": -1, "ep": 2}, 2) == ParallelDims(dp_shard=2, ep=2)
    with pytest.raises(ConfigError, match="ep 2 borrows its ranks from dp_shard 3, which it does not divide"):
        parse_mesh({"dp_shard": 3, "ep": 2}, 3)
    with pytest.raises(ConfigError, match="ep is -1 beside dp_shard, whose ranks ep borrows"):
        parse_mesh({"dp_shard": 2, "ep": -1}, 2)
    with pytest.raises(ConfigError, match=r"multiplies to 2 processes \(ep borrows the ranks of dp_shard\) but"):
        parse_mesh({"dp_shard": 2, "ep": 2}, 4)


@pytest.mark.parametrize("other", [{"pp": 2}, {"cp": 2}])
def test_ep_beside_another_axis_is_refused(other):
    axis = next(iter(other))
    with pytest.raises(
        ConfigError,
        match=rf"combines ep 2 with {axis} 2, but kiln runs the expert axis alone, within dp_shard, beside tp or "
        r"beside dp_replicate so far \(not with cp or pp, nor with two of dp_replicate, dp_shard and tp at once\); "
        r"set the other axes to 1",
    ):
        parse_mesh({"ep": 2, **other}, 4)
    with pytest.raises(ConfigError, match=rf"combines ep 2 with {axis} 2\b"):
        parse_mesh({"ep": 2, "dp_shard": 2, **other}, 4)
    with pytest.raises(ConfigError, match=rf"combines ep 2 with {axis} 2\b"):
        parse_mesh({"ep": 2, "dp_replicate": 2, **other}, 8)


def test_ep_beside_dp_replicate_is_a_data_axis_of_its_own_and_not_with_dp_shard_or_tp_too():
    dims = parse_mesh({"dp_replicate": 2, "ep": 2}, 4)
    assert dims == ParallelDims(dp_replicate=2, ep=2) and not dims.ep_in_dp_shard and not dims.fsdp
    assert (dims.dp, dims.dp_cp, dims.stage_ranks, dims.model_ranks, dims.own_ep) == (4, 4, 4, 1, 2)
    assert [dims.data_rank(r) for r in range(4)] == [0, 1, 2, 3]  # every rank a data shard
    assert dims.mesh_axes() == (("dp_replicate", "dp_shard", "ep", "cp", "tp"), (2, 1, 2, 1, 1))
    assert dims.describe() == "dp_replicate 2 x ep 2"
    assert parse_mesh({"dp_replicate": -1, "ep": 2}, 4) == dims
    for other, world, named in (
        ({"dp_shard": 2}, 4, "dp_replicate 2 and dp_shard 2"),
        ({"tp": 2}, 8, "dp_replicate 2 and tp 2"),
        ({"dp_shard": 2, "tp": 2}, 8, "dp_replicate 2 and dp_shard 2 and tp 2"),
    ):
        with pytest.raises(ConfigError, match=rf"combines ep 2 with {named}, but kiln runs the expert axis"):
            parse_mesh({"dp_replicate": 2, "ep": 2, **other}, world)


def test_ep_beside_tp_is_a_data_axis_whose_ranks_hold_tp_groups_and_not_with_dp_shard_too():
    dims = parse_mesh({"ep": 2, "tp": 2}, 4)
    assert (dims.dp, dims.dp_cp, dims.stage_ranks, dims.model_ranks, dims.fsdp) == (2, 2, 4, 2, False)
    assert [dims.data_rank(r) for r in range(4)] == [0, 0, 1, 1]  # a tp pair reads one data shard
    assert dims.mesh_axes() == (("dp_replicate", "dp_shard", "ep", "cp", "tp"), (1, 1, 2, 1, 2))
    with pytest.raises(ConfigError, match=r"combines ep 2 with dp_shard 2 and tp 2, but kiln runs the expert axis"):
        parse_mesh({"ep": 2, "dp_shard": 2, "tp": 2}, 4)


def test_ep_beside_tp_leaves_the_experts_out_of_the_models_plan():
    from kiln.strategies.mesh.tp_plan import resolve_plan

    model = moe()
    experts = {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    plan = resolve_plan(model, "auto", leave=experts)
    assert sorted({name.split(".", 3)[-1] for name in plan}) == [
        "embed_tokens",
        "lm_head",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    with pytest.raises(ConfigError, match="unknown style 'packed_colwise'"):  # the experts' own styles
        resolve_plan(model, "auto")


def test_model_parallel_resolves_to_its_expert_parallel_class():
    from kiln.config import load_config
    from kiln.strategies.mesh.expert_parallel import ExpertParallelStrategy
    from kiln.strategies.model_parallel.strategy import ModelParallelStrategy

    def resolved(mesh):
        return ModelParallelStrategy.resolve(load_config({"strategy": {"name": "model_parallel", "mesh": mesh}}))

    assert issubclass(resolved({"ep": 2}), ExpertParallelStrategy)
    assert resolved({"ep": 1}) is ModelParallelStrategy
    assert not issubclass(resolved({"dp_shard": 2}), ExpertParallelStrategy)


def test_models_ep_cannot_split_are_refused():
    from kiln.strategies.mesh.experts import check_experts
    from tests.strategies.pipeline.cases import llama

    with pytest.raises(ConfigError, match="LlamaForCausalLM has no experts module with fused 3-D expert weights"):
        check_experts(llama(), 2)
    with pytest.raises(
        ConfigError, match="model.layers.0.mlp.experts has 4 experts, which do not split evenly over ep 3"
    ):
        check_experts(moe(), 3)
    model = moe()
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(
        ConfigError, match=r"model.layers.1.mlp.experts \(MixtralExperts\) stores its experts with has_bias=True"
    ):
        check_experts(model, 2)
    assert list(check_experts(moe(), 4)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"strategy": {"offload": True}}, "offload"),
        ({"strategy": {"state_dict_type": "full"}}, "state_dict_type: full"),
        ({"strategy": {"tp_plan": {"model.layers.*.self_attn.q_proj": "colwise"}}}, r"tp_plan as a mapping"),
        ({"strategy": {"sequence_parallel": True}}, "sequence_parallel"),
        ({"train": {"gradient_checkpointing": True}}, "train.gradient_checkpointing"),
        ({"activation_checkpointing": {"mode": "selective"}}, "activation_checkpointing"),
        ({"train": {"torch_compile": True}}, "train.torch_compile"),
    ],
)
def test_what_ep_does_not_run_is_refused_at_config_load(overrides, named):
    from kiln.config import load_config
    from kiln.strategies.mesh.expert_parallel import check_expert_parallel
    from kiln.strategies.mesh.settings import MeshSettings, set_shared

    cfg = load_config({k: v for k, v in overrides.items() if k != "strategy"})
    settings = MeshSettings()
    for key, value in overrides.get("strategy", {}).items():
        set_shared(settings, key, value)
    with pytest.raises(ConfigError, match=rf"strategy.mesh.ep 2 does not run with {named}.* yet; drop it, or drop ep"):
        check_expert_parallel(2, settings, cfg, "fp32")
    check_expert_parallel(2, MeshSettings(), load_config({}), "bf16")  # the defaults run
    with pytest.raises(ConfigError, match="does not run with precision fp16 yet"):
        check_expert_parallel(2, MeshSettings(), None, "fp16")


@pytest.fixture
def one_rank_ep_mesh():
    """A gloo group of this process alone, and its 1-D `ep` DeviceMesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_the_expert_parallel_forward_is_transformers_own(one_rank_ep_mesh, kind):
    from kiln.strategies.mesh.experts import expert_modules, shard_experts, take_counts

    extra = {"output_router_logits": True} if kind != "deepseek_v3" else {}
    want_model = moe(kind, **extra)
    model = copy.deepcopy(want_model)
    routed = []  # the (token, k) expert choices transformers' own experts receive
    for module in expert_modules(want_model).values():
        module.register_forward_pre_hook(lambda _m, args: routed.append(args[1].reshape(-1)))
    shards = shard_experts(expert_modules(model), one_rank_ep_mesh)
    ids = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(0))
    want = want_model(input_ids=ids, labels=ids)
    got = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    grads = dict(want_model.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    counts = torch.stack([torch.bincount(r, minlength=4) for r in routed])
    assert torch.equal(take_counts(shards, one_rank_ep_mesh.get_group()), counts) and int(counts.sum()) == 21 * 2 * len(
        shards
    )
    model.eval()
    model(input_ids=ids)
    assert not take_counts(
        shards, one_rank_ep_mesh.get_group()
    ).any()  # evaluation forwards are not counted, and the counters were reset


def test_local_weight_is_to_local_with_the_weights_own_spec_on_its_gradient(one_rank_ep_mesh):
    """The experts' forward reads its weights through `local_weight`: the same values and gradient as
    DTensor's `to_local` (bitwise), the gradient a DTensor with the weight's placements, shape and
    stride, by the shortcut (no spec rebuilt) where the local piece is contiguous, by `to_local` where not."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from kiln.strategies.mesh.experts import local_weight

    full = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(1))
    grads = []
    for read in (local_weight, lambda w: w.to_local()):
        weight = torch.nn.Parameter(distribute_tensor(full, one_rank_ep_mesh, [Shard(0)]))
        local = read(weight)
        assert torch.equal(local, full)
        (local * upstream).sum().backward()
        grads.append((weight.grad, type(local.grad_fn).__name__))
    (got, fn), (want, _) = grads
    assert fn == "_ToLocalBackward"  # the shortcut, not torch's _ToTorchTensor
    assert isinstance(got, DTensor) and torch.equal(got.to_local(), want.to_local())
    assert (got.placements, got.shape, got.stride()) == (want.placements, want.shape, want.stride())
    bent = DTensor.from_local(full.transpose(1, 2), one_rank_ep_mesh, [Shard(0)])  # not contiguous: to_local
    assert type(local_weight(bent.requires_grad_()).grad_fn).__name__ != "_ToLocalBackward"
    assert local_weight(full) is full  # a plain tensor (no ep mesh) is its own local piece


def _step_arithmetic(strategy, model, params, experts, expert_share=1.0):
    """What the fake group's no-op collectives leave visible: the all-reduced sums are this rank's own
    values, so averaging divides them by the data ranks (4); a missing gradient becomes zeros; the global
    norm counts a replicated gradient once (1/4 on each of 4 ranks) and an expert shard once (whole
    under ep 4: `expert_share` 1; half on each of the 2 ranks holding it beside dp_replicate 2); the
    tokens per expert are this rank's counts per step. Returns what averaging all-reduced: (elements,
    the group's ranks or None for every rank) per call."""
    from unittest import mock

    import torch.distributed as dist

    reduced = []
    real = dist.all_reduce

    def all_reduce(tensor, *args, group=None, **kw):
        reduced.append((tensor.numel(), None if group is None else dist.get_process_group_ranks(group)))
        return real(tensor, *args, group=group, **kw)

    from torch.distributed.tensor import DTensor

    plain = [p for p in params.values() if not isinstance(p, DTensor)]
    for i, p in enumerate(plain):
        p.grad = None if i == 0 else torch.full_like(p, 2.0)
    for p in experts.values():
        p.grad = DTensor.from_local(torch.full_like(p.to_local(), 8.0), p.device_mesh, p.placements)
    with mock.patch.object(dist, "all_reduce", all_reduce):
        strategy.average_gradients()
    assert not plain[0].grad.any() and all(bool((p.grad == 0.5).all()) for p in plain[1:])
    assert all(bool((p.grad.to_local() == 2.0).all()) for p in experts.values())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    norm = strategy.clip_gradients(model, optimizer, max_norm=1e9)
    squares = sum(p.numel() for p in plain[1:]) * 0.25 / 4
    squares += sum(p.to_local().numel() for p in experts.values()) * 4.0 * expert_share
    torch.testing.assert_close(norm, torch.tensor(squares).sqrt())
    for layer, shard in enumerate(strategy._shards):
        shard.counts.copy_(torch.tensor([4, 0, 2, 10]) * (layer + 1))
    figures = strategy.step_figures(2)
    assert figures == {
        "moe/tokens_per_expert_mean": 3.0,  # layer 0: 2, 0, 1, 5 a step (mean 2); layer 1 twice that (mean 4)
        "moe/tokens_per_expert_min": 0.0,
        "moe/tokens_per_expert_max": 10.0,
        "moe/tokens_per_expert_imbalance": 2.5,
    }
    assert not any(shard.counts.any() for shard in strategy._shards)  # read once, then counted afresh
    return reduced


def test_one_rank_of_a_fake_world_holds_its_experts(caplog, monkeypatch):
    """ep 4, rank 2 (torch's fake process group: every collective a no-op, the mesh and the sharding
    real): mesh coordinate 2 on ep, data shard 2 of 4, expert 2 of each layer, the rest whole."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies.model_parallel.strategy import ModelParallelStrategy

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        # ep -1: built as a 1-process launch, then the group made here sets the world (setup_environment)
        cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu", "mesh": {"ep": -1}}})
        strategy = ModelParallelStrategy.resolve(cfg)(cfg, build_precision(cfg))
        with caplog.at_level("INFO", logger="kiln.strategies.mesh.expert_parallel"):
            model = strategy.setup_module(moe())
        assert "2 MoE layer(s), 1 of 4 experts each on this rank (ep 4)" in caplog.text
        mesh = strategy.device_mesh
        assert type(strategy).__name__ == "ModelParallelExperts"
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "ep", "cp", "tp") and mesh.shape == (1, 1, 4, 1, 1)
        assert list(mesh.get_coordinate()) == [0, 0, 2, 0, 0]
        facts = (strategy.data_shards, strategy.data_shard_rank, strategy.item_shards, strategy.grad_divisor)
        assert facts == (4, 2, 4, 4)
        params = dict(model.named_parameters())
        experts = {name: p for name, p in params.items() if isinstance(p, DTensor)}
        assert sorted(experts) == [
            f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj", "gate_up_proj")
        ]
        for p in experts.values():
            assert p.device_mesh.mesh_dim_names == ("ep",) and [repr(x) for x in p.placements] == ["Shard(dim=0)"]
            local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            assert p.to_local().shape == (1, *p.shape[1:]) == local and p.shape[0] == 4
            assert tuple(offset) == (2, 0, 0)  # the third expert's rows
        assert len(params) > len(experts)  # the rest stays whole, a plain tensor on every rank
        reduced = _step_arithmetic(strategy, model, params, experts)
        plain = sum(p.numel() for p in params.values() if not isinstance(p, DTensor))
        assert reduced == [(plain, None)]  # the replicated gradients, once; the experts' only divided
        _generation_is_synced(strategy, model, monkeypatch)
        strategy.teardown()
    finally:
        dist.destroy_process_group()


def test_one_rank_of_a_fake_world_with_ep_beside_dp_replicate(caplog):
    """dp_replicate 2 x ep 2, rank 3: replica 1, ep rank 1 (experts 2 and 3, as rank 1 in the other
    replica), data shard 3 of 4, the rest whole; the replicated gradients are summed over every rank,
    the experts' over dp_replicate ({1, 3}: the ranks holding the same experts), each divided by 4."""
    import torch.distributed as dist
    from omegaconf import read_write
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies.model_parallel.strategy import ModelParallelExperts

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        # built for this 1-process launch, then given the mesh: the group made here decides the world
        cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu"}})
        strategy = ModelParallelExperts(cfg, build_precision(cfg))
        with read_write(cfg):
            cfg.strategy.options.mesh = {"dp_replicate": 2, "ep": 2}
        with caplog.at_level("INFO", logger="kiln.strategies.mesh.expert_parallel"):
            model = strategy.setup_module(moe())
        assert "2 MoE layer(s), 2 of 4 experts each on this rank (ep 2)" in caplog.text
        mesh = strategy.device_mesh
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "ep", "cp", "tp") and mesh.shape == (2, 1, 2, 1, 1)
        assert list(mesh.get_coordinate()) == [1, 0, 1, 0, 0]
        groups = {axis: dist.get_process_group_ranks(mesh[axis].get_group()) for axis in ("dp_replicate", "ep")}
        assert groups == {"dp_replicate": [1, 3], "ep": [2, 3]}
        assert strategy._count_group is None  # tokens per expert summed over every rank: all four differ
        facts = (strategy.data_shards, strategy.data_shard_rank, strategy.item_shards, strategy.grad_divisor)
        assert facts == (4, 3, 4, 4)
        params = dict(model.named_parameters())
        experts = {name: p for name, p in params.items() if isinstance(p, DTensor)}
        assert len(experts) == 4 and len(params) > len(experts)
        for p in experts.values():
            assert p.device_mesh.mesh_dim_names == ("ep",) and [repr(x) for x in p.placements] == ["Shard(dim=0)"]
            local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            assert p.to_local().shape == (2, *p.shape[1:]) == local and tuple(offset) == (2, 0, 0)
        reduced = _step_arithmetic(strategy, model, params, experts, expert_share=0.5)
        plain = sum(p.numel() for p in params.values() if not isinstance(p, DTensor))
        assert reduced == [(plain, None), (sum(p.to_local().numel() for p in experts.values()), [1, 3])]
        strategy.teardown()
    finally:
        dist.destroy_process_group()


def _generation_is_synced(strategy, model, monkeypatch):
    """Within an evaluation, `generate()` keeps the ranks stepping together (synced_gpus) unless the
    caller says otherwise; outside it, and on a module without generate, nothing changes."""
    calls = []
    monkeypatch.setattr(type(model), "generate", lambda self, **kw: calls.append(kw), raising=False)
    with strategy.eval_cast_context(model, None):
        model.generate(max_new_tokens=2)
        model.generate(synced_gpus=False)
    model.generate()
    assert calls == [{"max_new_tokens": 2, "synced_gpus": True}, {"synced_gpus": False}, {}]
    assert "generate" not in vars(model)
    plain = torch.nn.Linear(2, 2)
    with strategy.eval_cast_context(plain, None):
        assert not hasattr(plain, "generate")


def test_one_rank_of_a_fake_world_with_ep_within_dp_shard(caplog):
    """dp_shard 4 with ep 2, rank 3: ep rank 1 (experts 2 and 3) within dp_shard_mod_ep rank 1, so FSDP
    leaves it expert 3 alone; every other parameter a quarter of it, FSDP-sharded over all four ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from kiln.config import load_config
    from kiln.precision import build_precision

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        from omegaconf import read_write

        from kiln.strategies.model_parallel.strategy import ModelParallelExperts

        # built for this 1-process launch, then given the mesh: the group made here decides the world
        cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu"}})
        strategy = ModelParallelExperts(cfg, build_precision(cfg))
        with read_write(cfg):
            cfg.strategy.options.mesh = {"dp_shard": 4, "ep": 2}
        with caplog.at_level("INFO", logger="kiln.strategies.mesh.strategy"):
            model = strategy.setup_module(moe())
        assert (
            "2 MoE layer(s), 2 of 4 experts each on this rank (ep 2), FSDP over the 2 rank(s) of dp_shard_mod_ep, FSDP"
            " over 4 rank(s)" in caplog.text
        )
        mesh = strategy.device_mesh
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
        assert mesh.shape == (1, 2, 2, 1, 1) and list(mesh.get_coordinate()) == [0, 1, 1, 0, 0]
        groups = {axis: dist.get_process_group_ranks(mesh[axis].get_group()) for axis in ("dp_shard", "ep")}
        groups["dp_shard_mod_ep"] = dist.get_process_group_ranks(mesh["dp_shard_mod_ep"].get_group())
        assert groups == {"dp_shard": [0, 1, 2, 3], "ep": [2, 3], "dp_shard_mod_ep": [1, 3]}
        assert strategy._count_group is mesh["dp_shard"].get_group()  # tokens per expert summed over all four
        facts = (strategy.data_shards, strategy.data_shard_rank, strategy.item_shards, strategy.grad_divisor)
        assert facts == (4, 3, 4, 4)
        experts = model.model.layers[0].mlp.experts
        assert isinstance(experts, FSDPModule) and isinstance(model.model.layers[0], FSDPModule)
        group = experts._get_fsdp_state()._fsdp_param_group
        assert (
            group.gradient_divide_factor == 4.0 and group.force_sum_reduction_for_comms
        )  # the mean over dp_shard, gloo-safe
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            assert tuple(p.to_local().shape) == tuple(local), name
            if ".experts." in name:
                assert p.device_mesh.mesh_dim_names == ("dp_shard_mod_ep", "ep"), name
                assert local == (1, *p.shape[1:]) and tuple(offset) == (3, 0, 0), name  # expert 3
            else:
                assert p.device_mesh.mesh_dim_names == ("dp_shard",) and [repr(x) for x in p.placements] == [
                    "Shard(dim=0)"
                ], name
                assert offset[0] == min(3 * -(-p.shape[0] // 4), p.shape[0]), name  # the fourth quarter
        strategy.teardown()
        assert strategy.device_mesh is None and strategy._shards == [] and strategy._found == {}
    finally:
        dist.destroy_process_group()
