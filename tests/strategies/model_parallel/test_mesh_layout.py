"""The mesh and the parameters' layout as the strategy builds them, for worlds too large to start on
a CI machine: fake_world.py plays one rank of 8 or 4 processes under torch's fake process group
(collectives are no-ops, so nothing trains, but the DeviceMesh, the TP plan and FSDP2 are the real
ones). Parity tests see only the numbers; these see the mesh's named dimensions and sizes, the rank's
coordinate, data shard and data-parallel group, and each parameter's mesh, placements per axis and
local shard (the tiny Llama of cases.py: hidden 32, 4 heads, 2 key/value heads, MLP 64, vocab 64);
under cp also the rank's cp position, the chunk of a known batch it trains on and the refusal of
SDPA on CPU (see fake_world.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import run
from tests.strategies.model_parallel import cp_cases

HERE = Path(__file__).resolve().parent
AXES = ["dp_replicate", "dp_shard", "cp", "tp"]
HSDP_TP = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
HSDP = {"dp_replicate": 2, "dp_shard": 2}
DP_TP = {"dp_shard": 2, "tp": 2}
CP = {"cp": 2}
DP_CP = {"dp_shard": 2, "cp": 2}
HSDP_CP = {"dp_replicate": 2, "dp_shard": 2, "cp": 2}
SP_LP = {"sequence_parallel": True, "loss_parallel": True}
#: [world, rank, mesh, bf16(, options)], one fake world each (cp worlds train cp_cases.TokenLocalLM)
WORLDS = [
    [8, 5, HSDP_TP, True],
    [4, 2, HSDP, False],
    [4, 3, DP_TP, False],
    [2, 1, {"tp": 2}, True],
    [2, 1, CP, True],
    [4, 3, DP_CP, False],
    [8, 5, HSDP_CP, False],
    [4, 3, DP_TP, False, SP_LP],
    [2, 0, {"tp": 2}, False, {"loss_parallel": True, "tie_word_embeddings": True}],
    [8, 7, {"dp_shard": 2, "cp": 2, "tp": 2}, False, {"tp_plan": cp_cases.TOKEN_PLAN}],
]


@pytest.fixture(scope="module")
def layouts() -> list[dict]:
    proc = run([sys.executable, str(HERE / "fake_world.py"), json.dumps(WORLDS)], timeout=180)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _param(layout: dict, name: str) -> tuple:
    p = layout["params"][name]
    return p["mesh"], p["placements"], p["local"]


def _every_shard_accounted(layout: dict, sizes: dict[str, int]) -> None:
    """Each parameter's local shard times the ranks holding different pieces is the whole parameter."""
    for name, p in layout["params"].items():
        pieces = 1
        for axis, placement in zip(p["mesh"] or (), p["placements"] or ()):
            pieces *= 1 if placement == "Replicate()" else sizes[axis]
        local = p["local"][0] * (p["local"][1] if len(p["local"]) > 1 else 1)
        whole = p["global"][0] * (p["global"][1] if len(p["global"]) > 1 else 1)
        assert local * pieces == whole, name


def test_hsdp_x_tp_mesh_and_the_place_of_a_rank(layouts):
    """dp_replicate 2 x dp_shard 2 x tp 2, rank 5: replica 1, shard 0, TP rank 1 (row-major)."""
    mesh = layouts[0]
    assert mesh["names"] == AXES and mesh["sizes"] == [2, 2, 1, 2]
    assert mesh["coordinate"] == [1, 0, 0, 1]
    assert (mesh["data_shards"], mesh["data_shard_rank"], mesh["grad_divisor"]) == (4, 2, 4)
    assert mesh["dp_group"] == [1, 3, 5, 7]  # the ranks at TP position 1 in every data shard


# (parameter, its mesh, placements per axis, local shard) of the 8-rank HSDP x TP world
HSDP_TP_LAYOUT = [
    # colwise: TP splits the output features, FSDP shards that split again (strided), replicas hold it whole
    (
        "model.layers.0.self_attn.q_proj.weight",
        ["dp_replicate", "dp_shard", "tp"],
        ["Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        [8, 32],
    ),
    (
        "model.layers.0.self_attn.k_proj.weight",
        ["dp_replicate", "dp_shard", "tp"],
        ["Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        [4, 32],
    ),
    (
        "model.layers.1.mlp.up_proj.weight",
        ["dp_replicate", "dp_shard", "tp"],
        ["Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        [16, 32],
    ),
    # rowwise: TP splits the input features, FSDP the rows
    (
        "model.layers.0.self_attn.o_proj.weight",
        ["dp_replicate", "dp_shard", "tp"],
        ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"],
        [16, 16],
    ),
    (
        "model.layers.1.mlp.down_proj.weight",
        ["dp_replicate", "dp_shard", "tp"],
        ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"],
        [16, 32],
    ),
    # the vocabulary split of the embedding and of lm_head (gathered output)
    (
        "model.embed_tokens.weight",
        ["dp_replicate", "dp_shard", "tp"],
        ["Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        [16, 32],
    ),
    (
        "lm_head.weight",
        ["dp_replicate", "dp_shard", "tp"],
        ["Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        [16, 32],
    ),
    # not in the plan: FSDP alone, on the 2-D data-parallel mesh
    ("model.layers.0.input_layernorm.weight", ["dp_replicate", "dp_shard"], ["Replicate()", "Shard(dim=0)"], [16]),
    ("model.norm.weight", ["dp_replicate", "dp_shard"], ["Replicate()", "Shard(dim=0)"], [16]),
]


@pytest.mark.parametrize("name, mesh, placements, local", HSDP_TP_LAYOUT, ids=[row[0] for row in HSDP_TP_LAYOUT])
def test_hsdp_x_tp_parameter_layout(layouts, name, mesh, placements, local):
    assert _param(layouts[0], name) == (mesh, placements, local)


def test_hsdp_x_tp_splits_every_planned_layer_and_shards_everything(layouts):
    params = layouts[0]["params"]
    split = [n for n, p in params.items() if p["mesh"] and "tp" in p["mesh"]]
    assert len(split) == 2 * 7 + 2 and len(params) == 2 * 9 + 3  # 7 projections a layer, embedding, lm_head
    assert all(p["mesh"] for p in params.values())  # no plain tensor left: FSDP sharded the rest
    assert layouts[0]["reshard_after_forward"] == [True]  # every unit frees its gathered weights after forward
    _every_shard_accounted(layouts[0], HSDP_TP)


def test_hsdp_alone_is_fsdp_on_a_2d_data_parallel_mesh(layouts):
    """dp_replicate 2 x dp_shard 2, rank 2: replica 1, shard 0; no TP group, so no data-parallel subgroup."""
    mesh = layouts[1]
    assert mesh["sizes"] == [2, 2, 1, 1] and mesh["coordinate"] == [1, 0, 0, 0]
    assert (mesh["data_shards"], mesh["data_shard_rank"], mesh["grad_divisor"], mesh["dp_group"]) == (4, 2, 4, None)
    for name, p in mesh["params"].items():
        assert (p["mesh"], p["placements"]) == (["dp_replicate", "dp_shard"], ["Replicate()", "Shard(dim=0)"]), name
        assert p["local"][0] * 2 == p["global"][0], name
    _every_shard_accounted(mesh, HSDP)


def test_dp_shard_x_tp_has_no_replicate_axis(layouts):
    """dp_shard 2 x tp 2, rank 3: shard 1, TP rank 1; FSDP's mesh is dp_shard alone."""
    mesh = layouts[2]
    assert mesh["sizes"] == [1, 2, 1, 2] and mesh["coordinate"] == [0, 1, 0, 1]
    assert (mesh["data_shards"], mesh["data_shard_rank"], mesh["grad_divisor"], mesh["dp_group"]) == (2, 1, 2, [1, 3])
    assert _param(mesh, "model.layers.0.self_attn.q_proj.weight") == (
        ["dp_shard", "tp"],
        ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        [8, 32],
    )
    assert _param(mesh, "model.norm.weight") == (["dp_shard"], ["Shard(dim=0)"], [16])
    _every_shard_accounted(mesh, DP_TP)


def test_bf16_is_fsdp2_mixed_precision_over_dp_axes_and_autocast_under_tp_alone(layouts):
    """With data-parallel axes, every FSDP unit gathers in bf16 (the policy) and the precision plugin
    no longer autocasts (FSDP casts); with tp alone there is no FSDP unit and autocast stays."""
    hsdp_tp, fp32, tp_alone = layouts[0], layouts[1], layouts[3]
    assert hsdp_tp["fsdp_param_dtypes"] == ["torch.bfloat16"] and hsdp_tp["precision"].startswith("FSDP")
    assert fp32["fsdp_param_dtypes"] == ["None"]  # fp32: FSDP keeps the parameters' own dtype
    assert tp_alone["fsdp_param_dtypes"] == [] and not tp_alone["precision"].startswith("FSDP")
    assert tp_alone["sizes"] == [1, 1, 1, 2] and tp_alone["dp_group"] is None


# -- context parallel -------------------------------------------------------------------------------


def test_cp_alone_shards_fsdp_over_the_cp_ranks(layouts):
    """cp 2, rank 1: one data shard read by both ranks, FSDP2 over `dp_shard_cp` (cp alone here), so
    the two ranks' gradients (from different tokens) are reduced and divided by 2."""
    mesh = layouts[4]
    assert mesh["sizes"] == [1, 1, 2, 1] and mesh["coordinate"] == [0, 0, 1, 0] and mesh["cp_rank"] == 1
    assert (mesh["data_shards"], mesh["data_shard_rank"], mesh["item_shards"], mesh["grad_divisor"]) == (1, 0, 2, 2)
    assert mesh["dp_group"] is None  # no tp: sums and means span every rank
    for name, p in mesh["params"].items():
        assert (p["mesh"], p["placements"]) == (["dp_shard_cp"], ["Shard(dim=0)"]), name
    _every_shard_accounted(mesh, {"dp_shard_cp": 2})
    assert mesh["fsdp_param_dtypes"] == ["torch.bfloat16"] and mesh["precision"].startswith(
        "FSDP"
    )  # bf16: FSDP's policy


def test_cp_rank_trains_on_its_own_chunk_and_evaluates_whole_sequences(layouts):
    """Rank 1 of cp 2 (load balanced) keeps pieces 1 and 2 of 4: tokens 2..5 of every row, at their
    true positions, each with its next token's label; an evaluation batch stays whole."""
    mesh = layouts[4]
    chunk = mesh["chunk"]
    assert chunk["input_ids"] == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert chunk["position_ids"] == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert chunk["labels"] == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert chunk["shift_labels"] == [[103, 104, 105, 106], [111, 112, 113, 114]]  # 106: rank 0's token
    assert mesh["eval_keys"] == ["input_ids", "labels"] and mesh["eval_ids"] == [list(range(8)), list(range(8, 16))]


def test_sdpa_under_cp_on_cpu_is_refused_with_the_sentence(layouts):
    assert layouts[4]["sdpa"] == (
        "context parallel's ring attention needs CUDA SDPA (flash/efficient/cudnn); on CPU use cp: 1."
    )
    assert layouts[3]["sdpa"] == layouts[1]["sdpa"] == "ran"  # no cp (tp 2; HSDP): plain SDPA, no CP dispatcher


def test_dp_shard_x_cp_flattens_both_into_fsdps_shard_axis(layouts):
    """dp_shard 2 x cp 2, rank 3: shard 1, cp rank 1; FSDP over dp_shard_cp (4 ranks)."""
    mesh = layouts[5]
    assert mesh["sizes"] == [1, 2, 2, 1] and mesh["coordinate"] == [0, 1, 1, 0] and mesh["cp_rank"] == 1
    assert (mesh["data_shards"], mesh["data_shard_rank"], mesh["item_shards"], mesh["grad_divisor"]) == (2, 1, 4, 4)
    assert {tuple(p["mesh"]) for p in mesh["params"].values()} == {("dp_shard_cp",)}
    _every_shard_accounted(mesh, {"dp_shard_cp": 4})
    assert mesh["chunk"]["input_ids"] == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_hsdp_x_cp_replicates_over_dp_replicate_and_shards_over_dp_shard_cp(layouts):
    """dp_replicate 2 x dp_shard 2 x cp 2, rank 5: replica 1, shard 0, cp rank 1 (data shard 2 of 4)."""
    mesh = layouts[6]
    assert mesh["sizes"] == [2, 2, 2, 1] and mesh["coordinate"] == [1, 0, 1, 0] and mesh["cp_rank"] == 1
    assert (mesh["data_shards"], mesh["data_shard_rank"], mesh["item_shards"], mesh["grad_divisor"]) == (4, 2, 8, 8)
    for name, p in mesh["params"].items():
        assert (p["mesh"], p["placements"]) == (["dp_replicate", "dp_shard_cp"], ["Replicate()", "Shard(dim=0)"]), name
    _every_shard_accounted(mesh, {"dp_replicate": 2, "dp_shard_cp": 4})


def test_dp_shard_x_cp_x_tp_splits_tokens_over_cp_and_features_over_tp(layouts):
    """dp_shard 2 x cp 2 x tp 2, rank 7: shard 1, cp rank 1, tp rank 1. The four ranks of a cp x tp
    block read one data shard; both tp ranks of a cp position train on the same chunk; FSDP shards
    over dp_shard_cp beside the tp split of the planned MLP; sums span the 4 ranks at this tp position."""
    mesh = layouts[9]
    assert mesh["sizes"] == [1, 2, 2, 2] and mesh["coordinate"] == [0, 1, 1, 1] and mesh["cp_rank"] == 1
    assert (mesh["data_shards"], mesh["data_shard_rank"], mesh["item_shards"], mesh["grad_divisor"]) == (2, 1, 4, 4)
    assert mesh["dp_group"] == [1, 3, 5, 7]  # dp x cp at tp position 1: each token counted once
    assert mesh["chunk"]["input_ids"] == [[2, 3, 4, 5], [10, 11, 12, 13]]  # cp rank 1's pieces, whatever the tp rank
    params = mesh["params"]
    assert params["mlp.1.weight"]["mesh"] == ["dp_shard_cp", "tp"] and params["mlp.1.weight"]["local"] == [8, 32]
    assert params["mlp.1.weight"]["placements"][1] == "Shard(dim=0)"  # colwise: output features split over tp
    assert params["mlp.3.weight"]["placements"][1] == "Shard(dim=1)"  # rowwise
    assert params["embed.weight"]["mesh"] == ["dp_shard_cp"]  # unplanned: FSDP alone
    _every_shard_accounted(mesh, {"dp_shard_cp": 4, "tp": 2})
    assert mesh["sdpa"] == layouts[4]["sdpa"]  # the ring dispatcher is entered (and refused on CPU) with tp too


# -- sequence and loss parallelism (their activations: test_sequence_loss_parallel.py) ----------------

SP_LP_LAYOUT = [
    # the norms take SequenceParallel's replicated weights on tp, which FSDP then shards over dp_shard
    ("model.norm.weight", ["dp_shard", "tp"], ["Shard(dim=0)", "Replicate()"], [16]),
    ("model.layers.1.post_attention_layernorm.weight", ["dp_shard", "tp"], ["Shard(dim=0)", "Replicate()"], [16]),
    # the split layers keep plain tensor parallelism's layout: only their activations change
    ("model.layers.0.self_attn.o_proj.weight", ["dp_shard", "tp"], ["Shard(dim=0)", "Shard(dim=1)"], [16, 16]),
    ("lm_head.weight", ["dp_shard", "tp"], ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"], [16, 32]),
    ("model.embed_tokens.weight", ["dp_shard", "tp"], ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"], [16, 32]),
]


@pytest.mark.parametrize("name, mesh, placements, local", SP_LP_LAYOUT, ids=[row[0] for row in SP_LP_LAYOUT])
def test_sequence_parallel_norms_are_replicated_on_tp_and_sharded_by_fsdp(layouts, name, mesh, placements, local):
    assert _param(layouts[7], name) == (mesh, placements, local)


def test_sequence_and_loss_parallel_under_fsdp_leave_no_plain_tensor(layouts):
    world = layouts[7]
    assert all(p["mesh"] for p in world["params"].values())
    _every_shard_accounted(world, DP_TP)
    assert world["loss_parallel"] and not layouts[2]["loss_parallel"]
    assert any("sequence parallel, loss parallel" in line for line in world["logs"])


def test_loss_parallel_with_tied_embeddings_keeps_the_head_whole_and_says_so(layouts):
    world = layouts[8]
    assert not world["loss_parallel"]
    assert world["params"]["model.embed_tokens.weight"]["mesh"] is None  # the tie (lm_head's weight too) stays whole
    assert any(
        "loss_parallel is off, the head's logits are gathered whole: tp_plan does not split the head lm_head" in line
        for line in world["logs"]
    )
